"""Non-finite steps: a step whose loss or gradient norm is NaN/Inf never updates the weights or the optimizer state,
decided on the device; the host reads the counts at metrics reads and stops the run as `model.nonfinite` says.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from dflash_lightning.errors import ConfigError

POLICIES = ("skip", "stop")


class NonFiniteError(RuntimeError):
    """Training met a NaN/Inf loss or gradient norm under `nonfinite: stop`, or too many in a row under `skip`."""


@dataclass(frozen=True)
class NonFiniteSettings:
    """What a non-finite step does to the run (`model.nonfinite`, `model.max_nonfinite_in_a_row`).

    Args:
        nonfinite: A step whose loss or gradient norm is NaN/Inf never updates the weights or the optimizer
            state (decided on the device). skip: count it (`train/skipped_steps`, read every `metrics_every`
            steps) and go on; stop: skip every update from then on and raise, naming the step and the batch's
            source records, at the next metrics read.
        max_nonfinite_in_a_row: Under `skip`, raise once this many steps in a row were skipped.
    """

    nonfinite: Literal["skip", "stop"]
    max_nonfinite_in_a_row: int

    def __post_init__(self) -> None:
        if self.max_nonfinite_in_a_row < 1:
            raise ConfigError(f"model.max_nonfinite_in_a_row must be >= 1, got {self.max_nonfinite_in_a_row}")
        if self.nonfinite not in POLICIES:
            raise ConfigError(f"model.nonfinite must be skip or stop, got {self.nonfinite!r}")


def clip_grad_norm(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> Tensor:
    """The gradient norm over all ranks, clipped to `max_norm` (inf: not clipped); through FSDP's own
    `clip_grad_norm_` (the norm over all shards) where the model has it."""
    if hasattr(model, "clip_grad_norm_"):
        return model.clip_grad_norm_(max_norm)  # Lightning's own norm clipping refuses FSDP
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)  # equal on all DDP ranks
    if max_norm < math.inf:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


class NonFiniteGuard(nn.Module):
    """Counts skipped steps on the device (the step never waits for the host) and raises `NonFiniteError` from counts
    the host reads, naming the step and the source records of its batch."""

    def __init__(self, settings: NonFiniteSettings, metrics_every: int) -> None:
        super().__init__()
        self.settings = settings
        # [skipped steps, skipped in a row, step index of the first skipped step (-1: none), steps seen] since this
        # process started training
        self.register_buffer("counts", torch.tensor([0, 0, -1, 0]), persistent=False)
        self.first_step = 0  # global step at which `counts` started counting
        self.recent_batches: deque[tuple[int, Tensor]] = deque(maxlen=4 * metrics_every)  # (step, sample ids)
        self.last_loss: Tensor | None = None

    def start(self, global_step: int) -> None:
        """Count from zero at the fit's first step."""
        self.counts.copy_(torch.tensor([0, 0, -1, 0]))
        self.first_step = global_step

    def remember(self, trainer: Any, batch: dict[str, Tensor]) -> None:
        """Keep the batch's sample ids (on the device, no copy) to name a bad batch's records later."""
        if "sample_ids" in batch:
            self.recent_batches.append((trainer.global_step, batch["sample_ids"]))

    def logs(self) -> dict[str, Tensor]:
        """The counts a measured step logs (last, so `check` finds them at the end of the host copy)."""
        return {"skipped_steps": self.counts[0], "skipped_in_a_row": self.counts[1]}

    def skip_if_nonfinite(self, optimizer: torch.optim.Optimizer, grad_norm: Tensor, trainer: Any) -> None:
        """Sets the fused optimizer's `found_inf` (as GradScaler does): a 1 skips the update, moments and step count."""
        bad = ~torch.isfinite(grad_norm.to(self.counts.device))
        if self.last_loss is not None:
            loss_bad = (~torch.isfinite(self.last_loss)).to(torch.int32)
            if trainer.world_size > 1:
                torch.distributed.all_reduce(loss_bad, op=torch.distributed.ReduceOp.MAX)  # every rank skips alike
            bad = bad | loss_bad.bool()
        counts, hit = self.counts, bad.long()
        counts[0] += hit
        counts[1] = (counts[1] + 1) * hit
        counts[2] = torch.where((counts[2] < 0) & bad, counts[3], counts[2])
        counts[3] += 1
        if self.settings.nonfinite == "stop":
            bad = bad | (counts[2] >= 0)  # after the first bad step nothing is applied until the host raises
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        optimizer.found_inf = bad.to(torch.float32)  # 0-dim, like the optimizer's step counts

    def check(self, trainer: Any, skipped: int | None = None, in_a_row: int | None = None) -> None:
        """Raise `NonFiniteError` as `nonfinite` says, from counts the host already has (else one copy)."""
        if skipped is None or in_a_row is None:
            skipped, in_a_row = self.counts[:2].tolist()
        limit = self.settings.max_nonfinite_in_a_row
        stop = self.settings.nonfinite == "stop" and skipped > 0
        if not stop and in_a_row < limit:
            return
        _, _, first, seen = self.counts.tolist()
        if stop:
            step = self.first_step + first
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {step} (nonfinite: stop): neither it nor a later update "
                f"was applied; batch records: {self._batch_sources(step, trainer)}"
            )
        last = self.first_step + seen - 1
        raise NonFiniteError(
            f"{in_a_row} steps in a row, through step {last}, had a non-finite loss or gradient norm and were skipped "
            f"(max_nonfinite_in_a_row: {limit}); last batch records: {self._batch_sources(last, trainer)}"
        )

    def summarise(self, trainer: Any, lr: float) -> None:
        """One line on the steps this process trained and skipped; more than half of them skipped fails the run (after
        its last checkpoint): its drafter barely trained, though no rule above stopped it."""
        skipped, _, first, seen = self.counts.tolist()
        if not seen:
            return
        start = self.first_step
        line = (f"steps {start}..{start + seen - 1} of this fit: {seen - skipped} trained, {skipped} skipped as "
                "non-finite")
        if skipped:
            line += f" (the first at step {start + first})"
        if 2 * skipped > seen:
            raise NonFiniteError(
                f"{line}: more than half, so the drafter barely trained; lower model.lr ({lr:g}) or "
                f"look at the records of step {start + first}: {self._batch_sources(start + first, trainer)}"
            )
        rank_zero_info(line)

    def _batch_sources(self, step: int, trainer: Any) -> str:
        """The file:line (or file:row N) of each record of the batch trained at `step`, if it is still known."""
        ids = next((t for s, t in reversed(self.recent_batches) if s == step), None)
        datamodule = getattr(trainer, "datamodule", None)
        if ids is None or not hasattr(datamodule, "train_locations"):
            return "unknown (not among the recent batches)"
        return ", ".join(datamodule.train_locations([i for i in ids.tolist() if i >= 0]))
