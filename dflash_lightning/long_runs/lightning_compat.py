"""Every use of Lightning's private API (and of torch's, on a scheduler Lightning steps), each behind a named function.

Each docstring says what the call does and why no public hook does it; tests/test_lightning_compat.py checks every
name against the installed release, so an upgrade that changes one fails there, by name, not inside a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.cli import LightningCLI

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import Tensor

# ------------------------------------------------------------------------------------------------- the module


def attached_trainer(module: LightningModule) -> Trainer | None:
    """The Trainer `module` is attached to, or None: the public `module.trainer` raises outside a Trainer."""
    return module._trainer


# ------------------------------------------------------------------------------------------------- the fit loop


def inside_accumulation(trainer: Trainer) -> bool:
    """Whether the batch just trained ends in no optimizer step (mid gradient accumulation); the loop's own rule
    (final batch, strategies that accumulate themselves) is not exposed."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def processed_batches(trainer: Trainer) -> int:
    """Batches the fit loop processed in this epoch (the data loader runs ahead); the progress classes are private."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


def saved_batch_progress(checkpoint: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The fit loop's batch counters in a checkpoint (`total` and `current`, each ready/started/processed/
    completed); the layout of the `loops` entry is Lightning's own, with no reader."""
    return checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]


# -------------------------------------------------------------------------------------------- ModelCheckpoint
# Lightning saves only from its hooks; a "save now" (preemption) and a `last` that always names the newest step
# (RunCheckpoint) need the steps those hooks take, which are private.


def monitor_candidates(callback: ModelCheckpoint, trainer: Trainer) -> dict[str, Tensor]:
    """The metrics a save names its file with and ranks by (logged metrics plus `epoch` and `step`)."""
    return callback._monitor_candidates(trainer)


def save_top_k(callback: ModelCheckpoint, trainer: Trainer, candidates: dict[str, Tensor]) -> None:
    """The save of a periodic step: a step file, kept if among the top K, the K+1st removed."""
    callback._save_topk_checkpoint(trainer, candidates)


def save_last(callback: ModelCheckpoint, trainer: Trainer, candidates: dict[str, Tensor]) -> None:
    """The `last` save (a link to the step file or a whole file); RunCheckpoint overrides it under this name."""
    callback._save_last_checkpoint(trainer, candidates)


def write_checkpoint(callback: ModelCheckpoint, trainer: Trainer, path: str) -> None:
    """Write the whole state to `path` and record it as this callback's latest save (notifying the loggers)."""
    callback._save_checkpoint(trainer, path)


def link_checkpoint(callback: ModelCheckpoint, trainer: Trainer, path: str, link: str) -> None:
    """Point `link` at the checkpoint `path` on rank 0 (a copy where links are refused), then wait for all ranks."""
    callback._link_checkpoint(trainer, path, link)


def should_remove(callback: ModelCheckpoint, trainer: Trainer, previous: str, current: str) -> bool:
    """Whether the replaced `previous` file is this run's own (in its folder, not the resumed-from file)."""
    return callback._should_remove_checkpoint(trainer, previous, current)


def remove_checkpoint(callback: ModelCheckpoint, trainer: Trainer, path: str) -> None:
    """Delete a checkpoint file through the Trainer's strategy (rank 0)."""
    callback._remove_checkpoint(trainer, path)


def skips_saving(callback: ModelCheckpoint, trainer: Trainer) -> bool:
    """Whether Lightning would save nothing now (fast_dev_run, not fitting, sanity check, this step saved)."""
    return callback._should_skip_saving_checkpoint(trainer)


def saved_step(callback: ModelCheckpoint) -> int:
    """The global step of this callback's latest save in this process (0 before any)."""
    return callback._last_global_step_saved


def saved_path(callback: ModelCheckpoint) -> str:
    """The file of this callback's latest save in this process ("" before any); `last_model_path` may be a link."""
    return callback._last_checkpoint_saved


def adopt_class(obj: Any, cls: type) -> None:
    """Make a built ModelCheckpoint (or strategy) an instance of its subclass `cls`, which adds no `__init__`
    state: the configs name the plain class (or `ddp`), and Lightning builds it with no hook to choose the class."""
    if "__init__" in vars(cls) or "__slots__" in vars(cls) or not isinstance(obj, cls.__mro__[1]):
        raise TypeError(f"{cls.__name__} must add no state to {cls.__mro__[1].__name__} to be adopted")
    obj.__class__ = cls


# ---------------------------------------------------------------------------------------------- the scheduler


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """Set what `scheduler.get_last_lr()` returns (torch's `_last_lr`), after the learning rates were set by hand
    on resume; torch updates it only in `step()`, which would advance the schedule."""
    scheduler._last_lr = list(lrs)


# ------------------------------------------------------------------------------------------------ LightningCLI


class TypedSettingsCLI(LightningCLI):
    """LightningCLI that keeps the typed settings when `--ckpt_path` is given: Lightning's replaces the model's by
    the checkpoint's hyper-parameters in `_parse_ckpt_path` (from 2.5.5 on), with no switch to turn that off."""

    def _parse_ckpt_path(self) -> None:
        """Nothing: the module compares the checkpoint's settings with these when it loads it (long_runs/resume.py)."""


__all__ = [
    "TypedSettingsCLI", "adopt_class", "attached_trainer", "inside_accumulation", "link_checkpoint",
    "monitor_candidates", "processed_batches", "remove_checkpoint", "save_last", "save_top_k", "saved_batch_progress",
    "saved_path", "saved_step", "set_last_lr", "should_remove", "skips_saving", "write_checkpoint",
]
