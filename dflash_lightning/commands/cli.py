"""Command line: `python -m dflash_lightning fit|validate|cache|export|evaluate|calibrate|regenerate ...`.

Each command is a `main(argv)` in `dflash_lightning/commands/`; this file only picks one.
"""

from __future__ import annotations

import sys

from jsonargparse import set_parsing_settings

from dflash_lightning.commands import cache, calibrate, evaluate, export, fit, regenerate
from dflash_lightning.commands.fit import DFlashCLI

# Commands that are not Trainer methods: name -> module with a `main(argv)`.
TOOLS = {"cache": cache, "export": export, "evaluate": evaluate, "calibrate": calibrate, "regenerate": regenerate}


def cli_main(args: list[str] | None = None, run: bool = True) -> DFlashCLI | None:
    """Entry point of `python -m dflash_lightning`; `run=False` only parses and instantiates fit/validate."""
    # --help shows each dataclass field's docstring (the drafter's fields, each part's settings)
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] in TOOLS:
        TOOLS[argv[0]].main(argv[1:])
        return None
    # None from the shell: LightningCLI reads sys.argv itself (given both, it warns that args and argv are mixed)
    return fit.main(args, run=run)


__all__ = ["DFlashCLI", "cli_main"]
