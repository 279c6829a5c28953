"""`python -m dflash_lightning export`: a Lightning checkpoint -> the Hugging Face folder that vLLM and SGLang load.

The arguments are `export`'s parameters; their help is its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

from jsonargparse import auto_cli

from dflash_lightning.export import export


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m dflash_lightning export --checkpoint X.ckpt --out folder`."""
    auto_cli(export, args=None if argv is None else list(argv))
