"""The drafter variants: each a named preset of parts on the DFlash backbone. The only place a variant is named.

`model.drafter.variant` picks a row; the code elsewhere asks the preset for its parts, its `architectures` name
(what vLLM and SGLang dispatch their loader on), its block layout (derived from its parts) and its serve commands,
never for its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_lightning.blocks import FILL_IN, BlockLayout
from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.base import Part, term_conflicts
from dflash_lightning.parts.convolutions import BlockConvolutions
from dflash_lightning.parts.domino import DominoCorrection
from dflash_lightning.parts.dspark import DSparkHeads
from dflash_lightning.parts.lilicorr import LiLiCorrReranker
from dflash_lightning.parts.selector import CandidateSelector
from dflash_lightning.parts.xpress import VLLM_ARCHITECTURE as XPRESS_ARCHITECTURE
from dflash_lightning.parts.xpress import XPress


@dataclass(frozen=True)
class Preset:
    """A drafter variant: the parts it adds to the backbone and how its folder names it."""

    parts: tuple[type[Part], ...]
    """Its parts, in the order they are built, trained, logged and exported."""
    architecture: str
    """config.json's `architectures` entry of its folder."""
    vllm_method: str | None = "dflash"
    """`--speculative-config` method that serves it in vLLM; None: vLLM has no runtime for it (`export` prints no
    vLLM command, and says so)."""
    sglang_algorithm: str | None = "DFLASH"
    """`--speculative-algorithm` that serves it in SGLang; None: SGLang has no runtime for it."""
    summary: str = ""
    """What it adds, for `--help` and errors."""

    def __post_init__(self) -> None:
        """Refuse, where the preset is made, parts whose training terms or drafting rules cannot work together
        (`base.term_conflicts`) or that name different block layouts."""
        self.layout  # noqa: B018
        if conflicts := term_conflicts(self.parts):
            raise ValueError(f"the parts of a preset cannot train together: {'; '.join(conflicts)}")

    @property
    def layout(self) -> BlockLayout:
        """The block layout its parts name (`Part.layout`), section 3's where none does."""
        named = {part.layout for part in self.parts if part.layout is not None}
        if len(named) > 1:
            names = ", ".join(f"{p.__name__} {p.layout}" for p in self.parts if p.layout is not None)
            raise ValueError(f"the parts of a preset name different block layouts: {names}")
        return named.pop() if named else FILL_IN


PRESETS: dict[str, Preset] = {
    "dflash": Preset((), "DFlashDraftModel", summary="the DFlash drafter (docs/method.md sections 2-9)"),
    "dflash2": Preset((BlockConvolutions, CandidateSelector), "DFlash2DraftModel",
                      summary="+ block convolutions and a candidate selector (section 10)"),
    "lilicorr": Preset((LiLiCorrReranker,), "LiLiCorrDraftModel",
                       summary="+ a candidate-lattice reranker that walks each slot's top K (section 11)"),
    "lilicorr-conv": Preset((BlockConvolutions, LiLiCorrReranker), "LiLiCorrDraftModel",
                            summary="+ the lattice reranker and the block convolutions (section 11)"),
    "dspark": Preset((DSparkHeads,), "Qwen3DSparkModel", vllm_method="dspark",
                     sglang_algorithm="DSPARK",
                     summary="anchor-first blocks + Markov and confidence heads (section 12)"),
    "domino": Preset((DominoCorrection,), "DFlashDraftModel", vllm_method=None,
                     summary="anchor-first blocks + a GRU prefix correction of the logits (section 13)"),
    "xpress": Preset((XPress,), XPRESS_ARCHITECTURE, sglang_algorithm=None,
                     summary="+ a causal low-rank refiner resolved by Jacobi passes (section 14)"),
}
"""Variant name -> preset. A new variant is a new row; a new kind of part is a new module in parts/."""
DEFAULT_VARIANT = "dflash"
"""The variant of a DrafterConfig that names none, and of a folder whose config.json has no `architectures`."""

ALL_PARTS: tuple[type[Part], ...] = tuple(dict.fromkeys(p for preset in PRESETS.values() for p in preset.parts))
"""Every part some preset uses, each once."""


def preset(variant: str) -> Preset:
    """The preset of a variant name; an unknown one is refused naming the known ones."""
    if variant not in PRESETS:
        raise ConfigError(f"variant: unknown drafter variant {variant!r}; use {' or '.join(PRESETS)}")
    return PRESETS[variant]


__all__ = ["ALL_PARTS", "DEFAULT_VARIANT", "PRESETS", "Preset", "preset"]
