"""`python -m dflash_lightning ...`."""

from dflash_lightning.cli import cli_main

if __name__ == "__main__":
    cli_main()
