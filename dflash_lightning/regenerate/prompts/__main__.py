"""`python -m dflash_lightning.regenerate.prompts build|self-written` (build.py)."""

from dflash_lightning.regenerate.prompts.build import main

main()
