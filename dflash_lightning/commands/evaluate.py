"""`python -m dflash_lightning evaluate`: served tau and speedup by real speculative decoding on held-out prompts.

The arguments are `evaluate_drafter`'s parameters; their help is its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

from jsonargparse import auto_cli

from dflash_lightning.decoding.evaluate import evaluate_drafter


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m dflash_lightning evaluate --drafter X --prompts prompts.jsonl [--target T]`."""
    auto_cli(evaluate_drafter, args=None if argv is None else list(argv))
