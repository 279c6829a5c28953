"""Draft quality metrics (docs/method.md section 5) as one torchmetrics Metric.

Top-k hits are counted from the head's top-k token ids, never through a `[tokens, vocab]` one-hot.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from dflash_lightning.blocks import FILL_IN, BlockLayout
from dflash_lightning.model import DraftOutput
from dflash_lightning.parts.base import Part


class DraftMetrics(Metric):
    """Per-slot top-k accuracy and the acceptance-length estimates of drafted blocks."""

    full_state_update = False

    def __init__(self, block_size: int, topk: tuple[int, ...] = (1, 5, 10), layout: BlockLayout = FILL_IN,
                 **kwargs) -> None:
        """`layout`: the block layout; accuracies are of the slots that predict, the accepted prefix of those that
        draft (`BlockLayout.draft_slots`)."""
        super().__init__(**kwargs)
        if 1 not in topk:
            raise ValueError(f"topk must include 1 (plain accuracy), got {topk}")
        self.block_size, self.topk, self.first = block_size, tuple(sorted(topk)), layout.first_slot
        self.draft_slots = layout.draft_slots(block_size)
        self.add_state("hits", torch.zeros(len(self.topk), block_size), dist_reduce_fx="sum")  # [k, B]
        self.add_state("slots", torch.zeros(block_size), dist_reduce_fx="sum")  # [B]
        self.add_state("accepted", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("blocks", torch.zeros(()), dist_reduce_fx="sum")

    def update(self, top_ids: Tensor, labels: Tensor, weights: Tensor) -> None:
        """Count hits of `top_ids [A, B, k]` (best first) against `labels [A, B]` where `weights > 0`."""
        supervised = weights > 0  # [A, B]
        match = top_ids == labels[..., None]  # [A, B, kmax]
        for i, k in enumerate(self.topk):
            self.hits[i] += (match[..., :k].any(-1) & supervised).sum(0).float()
        self.slots += supervised.sum(0).float()
        correct = match[..., 0] & supervised
        # Accepted prefix: consecutive correct drafts from the first; only blocks with a valid anchor count.
        valid_block = supervised[:, self.first]
        self.accepted += (correct[:, self.draft_slots].int().cumprod(-1).sum(-1) * valid_block).sum().float()
        self.blocks += valid_block.sum().float()

    def compute(self) -> dict[str, Tensor]:
        """acc per slot and top-k, tau (mean accepted prefix + 1) and the coarse product estimate."""
        acc = self.hits / self.slots.clamp_min(1)  # [k, B]
        out = {}
        for i, k in enumerate(self.topk):
            name = "acc" if k == 1 else f"top{k}"
            out[name] = acc[i, self.first:].mean()
            for slot in range(self.first, self.block_size):
                out[f"{name}/slot_{slot:02d}"] = acc[i, slot]
        out["tau"] = 1 + self.accepted / self.blocks.clamp_min(1)
        out["tau_coarse"] = 1 + acc[0, self.draft_slots].cumprod(0).sum()
        return out


class StageMetrics(nn.Module):
    """One stage's metrics (train or val): the backbone's `DraftMetrics` and each part's own (`Part.metric`), by the
    part's name."""

    def __init__(self, block_size: int, topk: tuple[int, ...], layout: BlockLayout, parts: tuple[Part, ...]) -> None:
        super().__init__()
        self.base = DraftMetrics(block_size, topk, layout)
        self.parts = nn.ModuleDict({p.name: m for p in parts if (m := p.metric(block_size)) is not None})

    def update(self, out: DraftOutput) -> None:
        """Feed one forward's results to the backbone's metrics and each part's."""
        self.base.update(out.topk, out.labels, out.supervised)
        for name, metric in self.parts.items():
            metric.update(out.parts[name].rows, out.labels, out.supervised)

    def compute(self) -> dict[str, Tensor]:
        """The metric values (the backbone's, then each part's), and reset them."""
        values = self.base.compute()
        self.base.reset()
        for metric in self.parts.values():
            values |= metric.compute()
            metric.reset()
        return values
