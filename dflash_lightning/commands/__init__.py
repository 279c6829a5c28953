"""The commands of `python -m dflash_lightning`: one file each, every one a `main(argv)`.

fit and validate (LightningCLI) are in fit.py; cache, export, evaluate and regenerate beside them.
"""
