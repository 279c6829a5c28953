"""`python -m dflash_lightning ...`."""

import sys

from dflash_lightning.checkpointing import CheckpointError
from dflash_lightning.cli import cli_main

if __name__ == "__main__":
    try:
        cli_main()
    except CheckpointError as err:  # a damaged or refused checkpoint: its path and what is wrong, one line
        sys.exit(f"error: {err}")
