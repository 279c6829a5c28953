"""`python -m dflash_lightning fit|validate`: LightningCLI over DFlashModule, DFlashDataModule and the target.

Values that data, model and target must share are typed once and linked (target_model/wiring.py checks them where
they meet): the target path, the token budget, the block size, the feature cache, the drafter's target layers
and whether the objective distills.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichModelSummary, RichProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy

from dflash_lightning.commands.console import RunModelSummary, RunProgressBar, quiet_lightning
from dflash_lightning.config import UnusedPartSettings
from dflash_lightning.data import DFlashDataModule
from dflash_lightning.decoding.validation import SpeculativeValidation
from dflash_lightning.long_runs.checkpointing import (
    AtomicCheckpointIO,
    CheckpointError,
    RunCheckpoint,
    check_writable,
    load_checkpoint,
    move_aside,
    newest_complete_checkpoint,
    remove_partials,
)
from dflash_lightning.long_runs.distributed_checkpoint import DistributedSaveDDP
from dflash_lightning.long_runs.lightning_compat import TypedSettingsCLI, adopt_class
from dflash_lightning.long_runs.preemption import Preemption
from dflash_lightning.long_runs.resume import ResumeError
from dflash_lightning.module import DFlashModule
from dflash_lightning.pictures.image_logging import ImageLogging
from dflash_lightning.target_model import TargetFeatures
from dflash_lightning.target_model.callback import check_target_settings

log = logging.getLogger(__name__)

TARGET_PATHS = ("target.path", "model.target", "spec_eval.target", "data.tokenizer", "data.target")
"""`target.path` and the settings it is linked to."""


class DFlashCLI(TypedSettingsCLI):
    """LightningCLI with `target`, `spec_eval`, `images` and `preemption` sections (callbacks) and the DFlash links."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Only the Trainer entry points that mean something for a drafter."""
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                "validate": {"model", "dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(TargetFeatures, "target")
        parser.add_lightning_class_args(SpeculativeValidation, "spec_eval")
        parser.add_lightning_class_args(ImageLogging, "images")
        parser.add_lightning_class_args(Preemption, "preemption")
        parser.link_arguments("target.path", "model.target")
        parser.link_arguments("target.path", "spec_eval.target")
        parser.link_arguments("target.dtype", "spec_eval.dtype")
        parser.link_arguments("target.path", "data.tokenizer")
        parser.link_arguments("data.token_budget", "model.token_budget")
        parser.link_arguments("model.drafter.block_size", "data.block_size")
        parser.link_arguments("target.path", "data.target")
        parser.link_arguments("data.token_budget", "target.token_budget")
        parser.link_arguments("data.feature_cache", "target.feature_cache")
        parser.link_arguments("model.accept_target_change", "data.accept_target_change")
        # the resolved drafter's (its layer choice needs the target's config) once the model is built
        for key in ("data.target_layer_ids", "target.layer_ids"):
            parser.link_arguments("model", key, compute_fn=_layer_ids, apply_on="instantiate")
        for key in ("data.final_hidden", "target.final_hidden"):
            parser.link_arguments("model", key, compute_fn=_needs_final_hidden, apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        """An accelerator this machine lacks, and a bad `target.*` value, are refused before the model's target is
        read or downloaded; and `--trainer.enable_progress_bar=false` leaves out the config's progress bar (every
        shipped config names one), where Lightning would refuse the pair: a cluster's log gets no bar, as asked."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_accelerator(config.trainer.get("accelerator"))
        check_target_settings(**config.target.as_dict())
        callbacks = config.trainer.get("callbacks")
        if config.trainer.get("enable_progress_bar") is not False or not isinstance(callbacks, list):
            return
        kept = [c for c in callbacks if not _is_progress_bar(c)]
        if len(kept) < len(callbacks):
            log.warning("trainer.enable_progress_bar=false: the config's progress bar callback is left out")
            config.trainer.callbacks = kept

    # ---------------------------------------------------------------- checkpoints and the automatic resume

    def instantiate_classes(self) -> None:
        """As LightningCLI's; a part's setting that the variant lacks, in a run resuming a checkpoint of another
        variant, is refused naming the changed variant first (the setting is the checkpoint variant's, left over)."""
        try:
            super().instantiate_classes()
        except UnusedPartSettings as err:
            path = self._resumed_checkpoint()
            saved = (load_checkpoint(path, mmap=True, verify=False).get("drafter_config") or {}).get("variant") \
                if path is not None else None
            if saved is not None and saved != err.variant:
                raise ResumeError(f"cannot resume from {path}: model.drafter.variant {saved!r} -> {err.variant!r} "
                                  f"changes what is trained; type the checkpoint's variant, or start a new run "
                                  f"(--preemption.resume=never, or another folder). Then also: {err}") from None
            raise

    def _resumed_checkpoint(self) -> Path | None:
        """The checkpoint this command would resume: `--ckpt_path`, else (fit, unless --preemption.resume=never) the
        newest complete one of the config's checkpoint folder, as `fit` picks it. None without a subcommand
        (`run=False`: nothing resumes)."""
        if not self.subcommand:
            return None
        config = self.config[self.subcommand]
        path = config.get("ckpt_path")
        if path not in (None, "last"):
            return Path(path)
        if self.subcommand != "fit" or (path is None and config.preemption.resume == "never"):
            return None
        folders = [(c.get("init_args") or {}).get("dirpath") for c in config.trainer.get("callbacks") or []
                   if str(c.get("class_path", "")).endswith("ModelCheckpoint")]
        root = config.trainer.get("default_root_dir") or "."
        return newest_complete_checkpoint(folders[0] or Path(root, "checkpoints")) if folders else None

    def parse_arguments(self, parser: Any, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        for key in TARGET_PATHS:  # `~/...` (configs/smollm2-135m.yaml): every reader gets the home folder spelled out,
            value = config.get(key)  # here, before Lightning 2.5 dumps the config as the model's hyper-parameters
            if isinstance(value, str) and value.startswith("~"):
                config[key] = str(Path(value).expanduser())
        ckpt_path = config.get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).exists():  # damage is refused in one line before anything reads it
            load_checkpoint(ckpt_path, mmap=True, required=("state_dict",))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with atomic checkpoint writes (unless the config names a CheckpointIO), distributed preemption
        saves under DDP, and a fixed folder."""
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO and not self._names_checkpoint_io():
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if type(trainer.strategy) is DDPStrategy:  # `ddp` or `auto` on several devices: every rank writes its share
            adopt_class(trainer.strategy, DistributedSaveDDP)
        for cb in trainer.checkpoint_callbacks:
            if type(cb) is ModelCheckpoint:  # the configs' plain class: `last` kept the newest (see RunCheckpoint)
                adopt_class(cb, RunCheckpoint)
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is None:  # version_N/ would change on every start
                cb.dirpath = str(Path(trainer.default_root_dir, "checkpoints").resolve())
        for cb in trainer.callbacks:  # the configs' bar and Lightning's summary: see commands/console.py
            if type(cb) is RichProgressBar:
                adopt_class(cb, RunProgressBar)
            elif type(cb) is RichModelSummary:
                adopt_class(cb, RunModelSummary)
        for logger in trainer.loggers:
            # Folder loggers pick the next free version_N when first asked; asked here, before any of them writes,
            # the ones sharing a folder (TensorBoard and CSV in the configs) land in the same version_N. Others
            # (MLflow, W&B) are left alone: asking theirs would start their run now.
            if isinstance(logger, (TensorBoardLogger, CSVLogger)):
                _ = logger.version
        for logger in trainer.loggers:  # CSV's folder made before TensorBoard writes to it: no "exists and is not
            if isinstance(logger, CSVLogger):  # empty" warning about a folder this very run shares
                _ = logger.experiment
        return trainer

    def _names_checkpoint_io(self) -> bool:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        plugins = config.get("trainer", {}).get("plugins") or []
        return any(isinstance(p, CheckpointIO) for p in (plugins if isinstance(plugins, list) else [plugins]))

    def fit(self, model: DFlashModule, ckpt_path: str | None = None, **kwargs: Any) -> None:
        """`Trainer.fit`, from the newest complete checkpoint unless `--ckpt_path` or `--preemption.resume=never`."""
        preemption = next((c for c in self.trainer.callbacks if isinstance(c, Preemption)), None)
        resume = preemption.resume if preemption is not None else "auto"
        folders = [cb.dirpath for cb in self.trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        if self.trainer.is_global_zero:
            for folder in folders:  # every start, --ckpt_path too: a killed save's leftover can be 12 GB
                check_writable(folder)
                remove_partials(folder)
        if ckpt_path == "last" and folders:  # Lightning's "last" knows only last.ckpt and else starts over silently
            found = newest_complete_checkpoint(folders[0])
            if found is None:
                raise CheckpointError(f"--ckpt_path=last: no complete checkpoint in {folders[0]}")
            log.warning(f"--ckpt_path=last: resuming from {found}, the newest complete checkpoint")
            ckpt_path = str(found)
        elif ckpt_path is None and folders and resume == "never":
            move_aside(folders[0])
        elif ckpt_path is None and folders:
            found = newest_complete_checkpoint(folders[0])
            if found is not None:
                log.warning(f"resuming from {found}, the newest complete checkpoint (--preemption.resume=never: fresh)")
                ckpt_path = str(found)
        self.trainer.fit(model, ckpt_path=ckpt_path, **kwargs)

    def before_fit(self) -> None:
        """Refuse what the device cannot run (FP8 off Hopper-class GPUs) before the target is loaded; the refusal names
        every flag to turn FP8 off, the target's too where it runs in FP8 (the GPU configs)."""
        target = next((c for c in self.trainer.callbacks if isinstance(c, TargetFeatures)), None)
        fp8_target = target is not None and target.fp8 and not target.feature_cache
        off = "--model.fp8=none --target.fp8=false" if fp8_target else None
        self.model.check_device(self.trainer.strategy.root_device, self.trainer.precision_plugin.precision, off)

    before_validate = before_fit


def check_accelerator(name: Any) -> None:
    """Refuse, as Lightning's Trainer would but first, a named accelerator (`gpu`, `cuda`, `mps`, ...) this machine
    does not have: the Trainer is built after the model, which reads (or downloads) the target."""
    if not isinstance(name, str) or name == "auto":
        return
    gpu = name == "gpu"
    known = ("cuda", "mps") if gpu else (name,) if name in AcceleratorRegistry else ()
    if not known or any(AcceleratorRegistry[n]["accelerator"].is_available() for n in known):
        return  # an accelerator of a plugin, or one that is here: the Trainer checks it
    here = [n for n in sorted(AcceleratorRegistry.available_accelerators())
            if AcceleratorRegistry[n]["accelerator"].is_available()]
    raise MisconfigurationException(
        f"trainer.accelerator={name}: this machine has no {'GPU' if gpu else name} (available: {', '.join(here)}); "
        "run on a machine that has one, or set --trainer.accelerator (configs/tiny.yaml runs on the CPU)")


def _is_progress_bar(callback: Any) -> bool:
    """Whether a config's callback entry (`class_path`, or an instance) is one of Lightning's progress bars."""
    if isinstance(callback, ProgressBar):
        return True
    path = getattr(callback, "class_path", None) or ""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, ProgressBar)


def _layer_ids(model: DFlashModule) -> list[int]:
    return list(model.drafter_config.target_layer_ids)


def _needs_final_hidden(model: DFlashModule) -> bool:
    return model.needs_final_hidden


def main(argv: Sequence[str] | None = None, run: bool = True) -> DFlashCLI:
    """`fit` or `validate` (the first of `argv`); `run=False` only parses and instantiates."""
    torch.set_float32_matmul_precision("high")
    quiet_lightning()
    return DFlashCLI(
        DFlashModule,
        DFlashDataModule,
        args=None if argv is None else list(argv),
        run=run,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_kwargs={"allow_abbrev": False},  # `--model.num_anchor=8` is an error, not num_anchors
    )
