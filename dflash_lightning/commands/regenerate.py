"""`python -m dflash_lightning regenerate`: rewrite each conversation's assistant turns with the target itself.

The arguments are `regenerate`'s parameters; their help is its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

from jsonargparse import auto_cli

from dflash_lightning.regenerate import regenerate


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m dflash_lightning regenerate --input_files ... --out ... --target ...` (or `--config x.yaml`)."""
    auto_cli(regenerate, args=None if argv is None else list(argv))
