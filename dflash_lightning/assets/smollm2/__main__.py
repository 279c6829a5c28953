"""`python -m dflash_lightning.assets.smollm2`: build the SmolLM2 target folder (see the package's docstring)."""

from dflash_lightning.assets.smollm2 import main

main()
