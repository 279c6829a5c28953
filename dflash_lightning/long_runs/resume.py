"""What a checkpoint records about the run that wrote it, and the check of a resumed run against that record.

A change that alters what is trained is refused before any step; the other changes take effect and are logged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, is_dataclass
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

from dflash_lightning.config import ConfigError, DrafterConfig, upgrade_record
from dflash_lightning.long_runs import lightning_compat as compat
from dflash_lightning.target_model.fingerprints import check_same_target, target_fingerprint, tokenizer_sha256

log = logging.getLogger(__name__)

RECORD_KEY = "dflash_run"  # the checkpoint entry that holds the record

# Fields (dotted; a trailing `.` is a whole section) that may change on resume: they take effect and are logged.
# Every other recorded field changes what is trained and is refused, a module or data setting added later too.
FREE = (
    "model.lr", "model.weight_decay", "model.betas", "model.warmup_ratio", "model.min_lr_ratio", "model.compile",
    "model.compile_mode", "model.compile_cache_dir", "model.metrics_every", "model.topk", "model.head_chunk_size",
    "model.fp8", "model.fp8_recipe",  # precision, like trainer.precision: the same weights, other matmuls
    "model.nonfinite", "model.max_nonfinite_in_a_row",  # policies of a bad step, not what is trained
    "model.accept_target_change",  # an override of one check, below
    "model.init_from",  # a warm start's source: a resumed run's weights are the checkpoint's
    "model.target", "target.path", "tokenizer.path", "data.tokenizer",  # paths: the fingerprints are compared
    "data.train_files", "data.val_files", "data.val_batches", "data.num_workers", "data.cache_dir",
    "data.feature_cache", "data.on_bad_record", "trainer.",
)
NOT_FREE = ("trainer.global_batch",)  # ... except this one
# `validate` checks only that the weights fit: their shape and their target.
FIXED_FOR_WEIGHTS = ("drafter.", "target.config_sha256", "tokenizer.sha256")
# The target's content, checked on its own (`check_same_target`: one line, and model.accept_target_change accepts it).
CONTENT = "target.weights_fingerprint"


class ResumeError(ConfigError):
    """A resumed run whose settings would train something else than the checkpoint's run."""


def _plain(value: Any) -> Any:
    """JSON-plain copy (tuples become lists), so that a record compares equal after a save and a load."""
    return json.loads(json.dumps(value, default=str))


def run_record(module: Any) -> dict[str, Any]:
    """The settings of a `DFlashModule`'s run that a checkpoint records: flat `section.field` -> plain value."""
    hp = module.hparams
    record: dict[str, Any] = {f"drafter.{k}": v for k, v in module.drafter_config.flat_dict().items()}
    # every hyper-parameter but the drafter's (resolved, above) and LightningCLI's `_instantiator`
    for key, value in hp.items():
        if key == "drafter" or key.startswith("_"):
            continue
        if is_dataclass(value) or isinstance(value, dict):  # a settings group (model.opd): one field each, named
            record |= {f"model.{key}.{k}": v for k, v in (asdict(value) if is_dataclass(value) else value).items()}
        else:
            record[f"model.{key}"] = value
    record["target.path"] = str(hp.target)
    record |= {f"target.{k}": v for k, v in target_fingerprint(hp.target).items()}
    trainer = compat.attached_trainer(module)
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    data = getattr(dm, "hparams", None) or {}
    tokenizer = data.get("tokenizer") or hp.target
    record["tokenizer.path"] = str(tokenizer)
    record["tokenizer.sha256"] = tokenizer_sha256(tokenizer)
    if data:
        record |= {f"data.{k}": v for k, v in data.items() if not k.startswith("_")}
        for name, attr in (("max_length", "max_length"), ("min_supervised_tokens", "min_supervised")):
            if hasattr(dm, attr):
                record[f"data.{name}"] = getattr(dm, attr)  # the resolved values, not the None defaults
    if trainer is not None:
        world, accumulate = trainer.world_size, trainer.accumulate_grad_batches
        record |= {"trainer.world_size": world, "trainer.accumulate_grad_batches": accumulate,
                   "trainer.global_batch": world * accumulate, "trainer.max_steps": trainer.max_steps,
                   "trainer.max_epochs": trainer.max_epochs, "trainer.precision": str(trainer.precision)}
    return _plain(record)


class RunRecord:
    """A `DFlashModule`'s run record (made once in a Trainer: the target is fingerprinted), written into each checkpoint
    beside the resolved drafter config and the precision, and checked against the record of a checkpoint resumed."""

    def __init__(self) -> None:
        self._record: dict[str, Any] | None = None

    def __call__(self, module: Any) -> dict[str, Any]:
        """This run's settings as a checkpoint records them."""
        trainer = compat.attached_trainer(module)
        if self._record is None or trainer is None:  # data and layout are known once in a Trainer
            record = run_record(module)
            if trainer is None:
                return record
            self._record = record
        return self._record

    def save(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """What a checkpoint carries beside the weights and the loops."""
        # The resolved drafter config lets export and evaluation work without re-reading the target.
        checkpoint["drafter_config"] = module.drafter_config.to_dict()
        checkpoint[RECORD_KEY] = self(module)
        trainer = compat.attached_trainer(module)
        if trainer is not None:  # export serves the drafter in the dtype it was trained in
            checkpoint["precision"] = str(trainer.precision)

    def check(self, module: Any, checkpoint: dict[str, Any]) -> bool:
        """Refuse a checkpoint of a run that trained something else (before its weights are loaded); whether a fit
        resumes from it. On another number of ranks (the global batch kept) the loop's per-rank batch counts are
        rescaled."""
        trainer, hp = compat.attached_trainer(module), module.hparams
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        saved = upgrade_record(checkpoint.get(RECORD_KEY))  # an older version's flat part fields moved
        if isinstance(checkpoint.get("drafter_config"), dict):
            checkpoint["drafter_config"] = DrafterConfig.from_dict(checkpoint["drafter_config"]).to_dict()
        path = getattr(trainer, "ckpt_path", None)
        if saved is not None:
            saved = {"model.stage": "sft", **saved}  # written before stages: supervised
            if fitting and saved["model.stage"] != hp.stage:
                raise ResumeError(
                    f"cannot resume from {path}: its run trained stage {saved['model.stage']!r}, this one is "
                    f"{hp.stage!r}; a new stage starts from the last one's weights in a new run folder, "
                    f"with --model.init_from={path}")
        check_resume(saved, self(module), path, fitting, hp.accept_target_change)
        check_weights(checkpoint, module.state_dict(), module.drafter_config.to_dict(), path)
        if fitting and saved is not None:
            check_step_boundary(checkpoint, path)
            rescale_loop_progress(checkpoint, saved.get("trainer.world_size", trainer.world_size), trainer.world_size)
        return fitting


def _matches(key: str, fields: tuple[str, ...]) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in fields)


def _fixed(key: str, weights_only: bool) -> bool:
    if weights_only:
        return _matches(key, FIXED_FOR_WEIGHTS)
    return _matches(key, NOT_FREE) or not _matches(key, FREE)


def compare(saved: dict[str, Any], current: dict[str, Any], weights_only: bool = False
            ) -> tuple[list[str], list[str]]:
    """(refused, changed): one `field: old -> new` line per differing field, split by whether it may change."""
    refused, changed = [], []
    missing = "(not recorded)"
    for key in sorted(current.keys() - {CONTENT}):  # a field unknown now (no Trainer, no data module): not compared
        old, new = saved.get(key, missing), current[key]
        if old == new:
            continue
        line = f"{key}: {old!r} -> {new!r}"
        if key == "trainer.global_batch" and "trainer.world_size" in current and isinstance(old, int):
            world = current["trainer.world_size"]
            ranks = f"{world} rank{'s' if world != 1 else ''}"
            line += (f" (packed rows per optimizer step; on {ranks} keep it with "
                     f"--trainer.accumulate_grad_batches={old // world})" if old % world == 0 else
                     f" (packed rows per optimizer step; {ranks} cannot make {old}: resume on a divisor of it)")
        (refused if _fixed(key, weights_only) and old != missing else changed).append(line)
    return refused, changed


def check_resume(saved: dict[str, Any] | None, current: dict[str, Any], path: str | None, fitting: bool,
                 accept_target_change: bool = False) -> list[str]:
    """Raise ResumeError naming every fixed field that differs, then `TargetChangedError` for other target weights
    (unless accepted); log and return the fields that changed."""
    where = f" from {path}" if path else ""
    if saved is None:
        log.warning(f"the checkpoint{where} has no settings record (written by an older version): the drafter's "
                    "shape is checked by the weights' shapes only, the target and tokenizer not at all")
        return []
    refused, changed = compare(saved, current, weights_only=not fitting)
    if refused:
        raise ResumeError(
            f"cannot resume{where}: these settings change what is trained (checkpoint -> now): "
            + "; ".join(refused)
            + ". Type the checkpoint's values, or start a new run (--preemption.resume=never, or another folder)"
        )
    if CONTENT in current:
        check_same_target(saved.get(CONTENT), current[CONTENT], f"the checkpoint {path or ''}".rstrip(),
                          current.get("target.path", "?"), accept_target_change)
    if changed:
        log.warning(f"resuming{where} with changed settings (checkpoint -> now), which take effect:\n  "
                    + "\n  ".join(changed))
    return changed


def check_weights(checkpoint: dict[str, Any], expected: dict[str, Any], drafter: dict[str, Any], path: str | None
                  ) -> None:
    """Refuse in one line a checkpoint whose weights are not those of this run's drafter (one of another model, or of
    an older version without a settings record): the drafter fields that differ, else the weights' names and shapes.
    """
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):  # a sharded checkpoint: the strategy loads the weights itself
        return
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    reshaped = [f"{k}: {list(state[k].shape)} -> {list(expected[k].shape)}" for k in expected
                if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    if not (missing or unexpected or reshaped):
        return
    saved, drafter = checkpoint.get("drafter_config"), _plain(drafter)
    fields = [f"drafter.{k}: {v!r} -> {drafter[k]!r}" for k, v in _plain(saved).items()
              if k in drafter and v != drafter[k]] if isinstance(saved, dict) else []

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")

    weights = "; ".join(f"{len(names)} {what} ({some(names)})" for what, names in (
        ("missing", missing), ("not in this drafter", unexpected), ("of another shape", reshaped)) if names)
    where = f"the checkpoint {path}" if path else "the checkpoint"
    kind = "this run's drafter" if isinstance(saved, dict) else "a DFlash drafter (no drafter_config)"
    raise ResumeError(f"{where} holds other weights than {kind}: "
                      + (f"drafter fields differ (checkpoint -> now): {'; '.join(fields)}; " if fields else "")
                      + f"weights: {weights}")


def mid_accumulation(checkpoint: dict[str, Any]) -> str | None:
    """Why a checkpoint cannot be resumed exactly when it was saved inside a gradient accumulation (the gradients of
    its unfinished optimizer step are not in it), in words; None for one saved at an optimizer-step boundary."""
    record = checkpoint.get(RECORD_KEY)
    accumulate = record.get("trainer.accumulate_grad_batches") if isinstance(record, dict) else None
    if not isinstance(accumulate, int) or accumulate < 2 or "loops" not in checkpoint:
        return None
    progress = compat.saved_batch_progress(checkpoint)
    done = progress["current"]["processed"] % accumulate
    if done == 0 or progress.get("is_last_batch"):  # Lightning steps on an epoch's last batch
        return None
    step = int(checkpoint.get("global_step", 0)) + 1
    return (f"saved mid-way through a gradient accumulation ({done} of {accumulate} micro-batches of step {step} "
            "trained, their gradients not saved; versions before 2026-12-04 saved so after a resume): a resume "
            "would train that step on part of its rows")


def check_step_boundary(checkpoint: dict[str, Any], path: str | None) -> None:
    """Refuse in one line a checkpoint saved inside a gradient accumulation (`mid_accumulation`), naming it."""
    reason = mid_accumulation(checkpoint)
    if reason is not None:
        raise ResumeError(f"cannot resume from {path or 'the checkpoint'}: {reason}. Resume from a checkpoint of "
                          "an earlier step (--ckpt_path=...; the automatic resume skips this one), or start a new "
                          "run (--preemption.resume=never)")


def rescale_loop_progress(checkpoint: dict[str, Any], old_world: int, new_world: int) -> None:
    """Rewrite the fit loop's batch counters (per rank) for `new_world` ranks; the optimizer steps stay.

    With the global batch kept, a rank of the new run has done `old_world / new_world` times the batches of a
    rank of the old one. Differences between the counters (they mark where in a batch the save happened) stay.
    """
    if old_world == new_world or "loops" not in checkpoint:
        return
    progress = compat.saved_batch_progress(checkpoint)
    for scope in ("total", "current"):
        counters = progress[scope]
        base = counters["processed"]
        if (base * old_world) % new_world:
            raise ResumeError(
                f"the checkpoint was written after {base} batches per rank on {old_world} ranks (mid-way through a "
                f"gradient accumulation), which {new_world} ranks cannot share: resume on {old_world} ranks"
            )
        new_base = base * old_world // new_world
        for name in ("ready", "started", "processed", "completed"):
            counters[name] = new_base + counters[name] - base
