"""Regenerated training data: the target rewrites the assistant turns (docs/method.md section 4).

generate.py drives it (in-process Hugging Face backend), openai_backend.py talks to a server, output.py writes in order.
"""

from dflash_lightning.regenerate.generate import regenerate

__all__ = ["regenerate"]
