"""The LightningModule that trains a DFlash drafter on packed, fixed-shape batches.

`configure_model` builds the drafter and its persistent step buffers, then compiles the drafter in
place; every training step copies the batch into those buffers, so shapes and addresses never change.
Its settings are grouped and checked in module_settings.py; the non-finite step guard, the run record that checkpoints
carry (checked on resume) and warm start are in long_runs/.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor

from dflash_lightning.blocks import anchor_seed, base_slot_weights, block_labels, select_anchors, teacher_positions
from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.data.packing import StepBuffers
from dflash_lightning.fp8 import Recipe, convert_linears
from dflash_lightning.long_runs import lightning_compat as compat
from dflash_lightning.long_runs import resume
from dflash_lightning.long_runs.nonfinite import NonFiniteGuard, clip_grad_norm
from dflash_lightning.long_runs.warm_start import warm_start
from dflash_lightning.loss import LossSettings
from dflash_lightning.metrics import StageMetrics
from dflash_lightning.model import DFlashDrafter, DraftOutput
from dflash_lightning.module_settings import ARGS_HELP, ModuleSettings
from dflash_lightning.opd import OPDSettings, accept_mask, greedy_drafts, opd_loss, replay, slot_kls
from dflash_lightning.target_model import load_target_config, load_target_io, tokenizer_ids
from dflash_lightning.target_model.callback import TargetFeatures


class DFlashModule(LightningModule):
    """Trains a DFlash drafter for a frozen target; the target itself lives in `TargetFeatures`."""

    def __init__(
        self,
        target: str,
        drafter: DrafterConfig = DrafterConfig(),  # noqa: B008 (read only; jsonargparse needs a plain dataclass)
        token_budget: int = 8192,
        num_anchors: int = 512,
        lr: float = 6e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_ratio: float = 0.04,
        min_lr_ratio: float = 0.0,
        compile: bool = False,
        compile_mode: str | None = None,
        compile_cache_dir: str | None = None,
        metrics_every: int = 8,
        topk: tuple[int, ...] = (1, 5, 10),
        head_chunk_size: int = 4096,
        objective: Literal["ce", "kl", "ce+kl"] = LossSettings.objective,  # defaults: LossSettings, as a bare drafter
        loss_weights: Literal["decay", "dpace"] = LossSettings.loss_weights,
        dpace_alpha: float = LossSettings.dpace_alpha,
        temperature: float = LossSettings.temperature,
        init_from: str | None = None,
        accept_target_change: bool = False,
        nonfinite: Literal["skip", "stop"] = "skip",
        max_nonfinite_in_a_row: int = 16,
        fp8: Literal["none", "head", "all"] = "none",
        fp8_recipe: Recipe = "rowwise",
        stage: Literal["sft", "opd"] = "sft",
        opd: OPDSettings = OPDSettings(),  # noqa: B008 (read only; jsonargparse needs a plain dataclass)
    ) -> None:
        # Each argument's help (the CLI's) is in the docstring of its group, beside its checks: module_settings.py.
        given = {k: v for k, v in locals().items() if k not in ("self", "__class__")}  # the arguments, as passed
        super().__init__()
        self.save_hyperparameters()  # the flat names: what checkpoints record and the CLI shows
        self.settings = ModuleSettings.from_flat(given)  # grouped and checked, before the target is read
        self.loss_settings, self.opd_settings = self.settings.loss, self.settings.stage.opd
        self.drafter_config = drafter.resolved(load_target_config(target), *tokenizer_ids(target))
        cfg = self.drafter_config
        self.settings.metrics.check_vocab(cfg.vocab_size)
        self.train_metrics, self.val_metrics = (StageMetrics(cfg.block_size, topk, cfg.layout, cfg.preset.parts)
                                                for _ in range(2))
        self.drafter: DFlashDrafter | None = None
        self.buffers_: StepBuffers | None = None
        self._anchor_generator: torch.Generator | None = None
        self.run_record = resume.RunRecord()  # what checkpoints record of this run, and their checks on resume
        self._resumed = False
        self.nonfinite_guard = NonFiniteGuard(self.settings.nonfinite, metrics_every)
        self._total_steps: float | None = None  # the Trainer's, once the optimizer is configured

    __init__.__doc__ = ARGS_HELP  # written once, with each group's checks

    def configure_model(self) -> None:
        """Build the drafter, attach the target's frozen embedding and head, make buffers, compile."""
        if self.drafter is not None:  # Lightning may call this more than once
            return
        cfg, run = self.drafter_config, self.settings
        if run.fp8.fp8 != "none":
            trainer = compat.attached_trainer(self)
            self.check_device(trainer.strategy.root_device if trainer is not None else self.device)
        self.drafter = DFlashDrafter(cfg)
        self.drafter.head_chunk_size = run.step.head_chunk_size
        self.drafter.loss_settings = self.loss_settings
        if run.stage.init_from:  # before FP8 conversion and compile; a resumed checkpoint's weights replace these
            warm_start(self.drafter, run.stage.init_from)
        if run.fp8.fp8 == "all":
            convert_linears(self.drafter, run.fp8.fp8_recipe)
        # Under bf16-mixed the weights stay fp32 (the masters); frozen tensors and inputs take the compute dtype.
        dtype = self._autocast_dtype()
        embed, head = load_target_io(run.target)
        self.drafter.set_target_io(embed.to(dtype or embed.dtype), head.to(dtype or head.dtype))
        self.buffers_ = StepBuffers(
            run.step.token_budget, cfg.num_context_layers * cfg.hidden_size,
            base_slot_weights(cfg.block_size, run.loss.loss_weights, cfg.loss_gamma, cfg.layout),
            cfg.hidden_size if self.needs_final_hidden else 0, dtype,
        )
        if run.compile.compile:
            if run.compile.compile_cache_dir:  # read by inductor at its first compile, which comes after this
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(run.compile.compile_cache_dir).resolve())
            self.drafter.compile_blocks(run.compile.compile_mode)

    def check_device(self, device: torch.device, precision: str | None = None, off: str | None = None) -> None:
        """Refuse settings the device or precision cannot run (`FP8Settings.check_device`), before any target is
        loaded: `precision` is the Trainer's, given where the module is not attached to it yet."""
        if precision is None:
            precision = getattr(getattr(compat.attached_trainer(self), "precision_plugin", None), "precision", None)
        self.settings.fp8.check_device(device, precision, off)

    def _autocast_dtype(self) -> torch.dtype | None:
        """bf16 (or fp16) where the Trainer computes under autocast over fp32 weights, else None."""
        trainer = compat.attached_trainer(self)
        plugin = trainer.precision_plugin if trainer is not None else None
        if isinstance(plugin, MixedPrecision):
            return torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
        return None

    def step(self, batch: dict[str, Tensor], topk: int = 0, generator: torch.Generator | None = None) -> DraftOutput:
        """Loss (and top-k ids) of one packed batch through the persistent buffers."""
        if "context_features" not in batch:
            raise RuntimeError("batch has no 'context_features': add the TargetFeatures callback to the Trainer")
        if self.needs_final_hidden and "final_hidden" not in batch:
            raise RuntimeError(
                f"{self.final_hidden_reason()} needs the target's final hidden states ('final_hidden') "
                "in each batch: TargetFeatures adds them; a feature cache must be written with --final_hidden true"
            )
        fp8, compiled = self.settings.fp8, self.settings.compile
        if fp8.fp8 != "none" and self.drafter.head_fp8 is None:  # once, on the device, in its final dtype
            self.drafter.use_fp8_head(fp8.fp8_recipe)
        buf = self.buffers_
        if compiled.compile and compiled.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # CUDA graph outputs of the last step may be overwritten
        buf.load(batch)
        anchors, valid = select_anchors(buf.loss_mask, buf.doc_ids, self.settings.step.num_anchors, generator)
        return self.drafter(
            buf.features, buf.input_ids, buf.position_ids, buf.doc_ids, buf.loss_mask,
            anchors, valid, buf.slot_weights, topk, buf.final_hidden,
        )

    def check_parts(self, total_steps: float | None = None, cfg: DrafterConfig | None = None) -> None:
        """Each part's rules for the run's settings (`ModuleSettings.check_parts`), on the resolved drafter."""
        self.settings.check_parts(cfg or self.drafter_config, total_steps)

    @property
    def needs_final_hidden(self) -> bool:
        """Whether training reads the target's final hidden states (`ModuleSettings.needs_final_hidden`)."""
        return self.settings.needs_final_hidden

    @property
    def nonfinite_counts(self) -> Tensor:
        """The guard's device counts: skipped steps, in a row, the first one's index, steps seen."""
        return self.nonfinite_guard.counts

    @property
    def replays(self) -> bool:
        """Whether each training step runs the target on the drafts (`model.stage=opd` with `model.opd.replay`)."""
        return self.settings.stage.stage == "opd" and self.opd_settings.replay

    def final_hidden_reason(self) -> str:
        """The setting that makes training read the target's final hidden states, named for an error line."""
        return self.settings.final_hidden_reason()

    def anchor_generator(self, batch: dict[str, Any], batch_idx: int) -> torch.Generator:
        """The generator of this batch's anchors, seeded from the batch's place in the stream: no state to save.

        Batches of other loaders (no `anchor_seed`) are keyed by step, batch and rank instead. The data module
        keeps the seed on the host, and seeding is host-side: no device sync.
        """
        seed = batch.get("anchor_seed")
        if seed is None:
            seed = anchor_seed(self.global_rank, "step", self.global_step, batch_idx)
        if self._anchor_generator is None or self._anchor_generator.device != self.device:
            self._anchor_generator = torch.Generator(self.device)
        return self._anchor_generator.manual_seed(int(seed))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        measure = batch_idx % self.settings.metrics.metrics_every == 0
        trainer = compat.attached_trainer(self)
        self.nonfinite_guard.remember(trainer, batch)
        for part in self.drafter.parts:  # what changes over the run (a curriculum), as device tensors in place
            part.set_step(trainer.global_step if trainer is not None else 0, self._total_steps)
        if self.settings.stage.stage == "opd":
            return self.opd_training_step(batch, measure, self.anchor_generator(batch, batch_idx))
        topk = max(self.settings.metrics.topk)
        out = self.step(batch, topk if measure else 0, self.anchor_generator(batch, batch_idx))
        self.nonfinite_guard.last_loss = out.loss.detach()
        if measure:  # logging only here keeps host syncs off the other steps
            self.train_metrics.update(out)
            extra = {"ce": out.ce} if self.loss_settings.distills else {}
            for part in out.parts.values():
                extra |= part.logs
            values = {**extra, **self.train_metrics.compute(), **self.nonfinite_guard.logs()}
            host = self._log_metrics("train", values, out.loss)
            self.nonfinite_guard.check(trainer, *host[-2:].long().tolist())
        return out.loss

    def opd_training_step(self, batch: dict[str, Tensor], measure: bool, generator: torch.Generator) -> Tensor:
        """The `opd` stage's step: its loss, logged with its parts (and the rollout's seconds) on measured steps."""
        loss, logs = self.opd_step(batch, generator, self._replay_target() if self.replays else None, measure)
        self.nonfinite_guard.last_loss = loss.detach()
        if measure:
            host = self._log_metrics("train", {**logs, **self.nonfinite_guard.logs()}, loss)
            self.nonfinite_guard.check(compat.attached_trainer(self), *host[-2:].long().tolist())
        return loss

    def opd_step(self, batch: dict[str, Tensor], generator: torch.Generator | None = None,
                 target: Any = None, timed: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
        """Draft-OPD's loss of one packed batch (docs/opd.md) and its logs: the drafter's greedy block at each anchor,
        the target's distribution at each slot (`target`, a FeatureExtractor: replayed on the drafts; None: the
        row's own `final_hidden`), the accept mask, the acceptance-aware loss. `timed`: the rollout's and the
        forward's seconds are logged, exact (a GPU is synchronised for them); else no step waits for the GPU."""
        if "context_features" not in batch or "final_hidden" not in batch:
            raise RuntimeError("model.stage 'opd' needs 'context_features' and 'final_hidden' in each batch: add the "
                               "TargetFeatures callback (a feature cache must be written with --final_hidden true)")
        buf, drafter, shape = self.buffers_, self.drafter, self.settings.step
        buf.load(batch)
        cfg, chunk = drafter.config, shape.head_chunk_size
        B, layout = cfg.block_size, cfg.layout
        anchors, valid = select_anchors(buf.loss_mask, buf.doc_ids, shape.num_anchors, generator)
        start = time.perf_counter()
        sft_weight = self.opd_settings.sft_weight
        if sft_weight:  # the supervised loss of the same blocks, beside the stage's: one drafter forward for both
            sft = drafter(buf.features, buf.input_ids, buf.position_ids, buf.doc_ids, buf.loss_mask, anchors, valid,
                          buf.slot_weights, 0, buf.final_hidden)
            hidden = sft.hidden
        else:
            hidden = drafter.block_hidden(buf.features, buf.input_ids, buf.position_ids, buf.doc_ids, anchors, valid)
        head = drafter.head_weight
        rollout = time.perf_counter()
        # The drafting rule: slot k's argmax is draft k (k >= 1); slot 0 is the anchor's own token.  # [A, B]
        tokens = greedy_drafts(hidden.detach().flatten(0, 1), head, chunk).view(-1, B)
        tokens[:, 0] = buf.input_ids[anchors]
        if target is not None:  # state j of a replayed block predicts slot j + 1
            states = replay(target, buf.input_ids, buf.position_ids, anchors, valid, tokens)  # [A, B, H]
            teacher = torch.cat([states[:, :1], states[:, :-1]], 1)
        else:  # the row's own state before each slot's label
            teacher = buf.final_hidden[teacher_positions(anchors, B, buf.input_ids.numel(), layout)]  # [A, B, H]
        if hidden.is_cuda and timed:  # the rollout's seconds (drafting and replay), on measured steps only
            torch.cuda.synchronize(hidden.device)
        rollout = time.perf_counter() - rollout
        forward_kl, reverse_kl, target_ids = (t.view(-1, B - 1) for t in slot_kls(
            hidden[:, 1:].flatten(0, 1), teacher[:, 1:].flatten(0, 1).detach(), head, chunk))
        zero = forward_kl.new_zeros(forward_kl.shape[0], 1)
        forward_kl, reverse_kl = torch.cat([zero, forward_kl], 1), torch.cat([zero, reverse_kl], 1)  # [A, B]
        accepted = accept_mask(tokens, torch.cat([tokens[:, :1], target_ids], 1), layout)  # [A, B]
        predicts = (torch.arange(B, device=anchors.device) >= layout.first_slot).float()
        supervised = block_labels(buf.input_ids, buf.loss_mask, buf.doc_ids, anchors, valid, predicts, layout)[1] > 0
        loss, logs = opd_loss(forward_kl, reverse_kl, accepted, supervised, self.opd_settings)
        if sft_weight:
            loss = loss + sft_weight * sft.loss
            logs["opd/sft"] = sft.loss.detach()
        logs["opd/tau"] = 1 + (accepted & supervised).sum() / valid.sum().clamp_min(1)  # greedy verification's
        if timed:  # a host value to the device waits for the GPU: on measured steps only, beside device values
            logs |= {"opd/rollout_s": torch.tensor(rollout, device=loss.device),
                     "opd/forward_s": torch.tensor(time.perf_counter() - start, device=loss.device)}
        return loss, logs

    def _replay_target(self) -> Any:
        """The target on this rank that replays the drafts: the TargetFeatures callback's (colocated or sharded)."""
        trainer = compat.attached_trainer(self)
        found = [cb for cb in (trainer.callbacks if trainer is not None else []) if isinstance(cb, TargetFeatures)]
        if not found or found[0].extractor is None:
            raise RuntimeError("model.opd.replay: no target runs on this rank (add the TargetFeatures callback with "
                               "placement colocated or sharded, or set --model.opd.replay=false)")
        return found[0].extractor

    def on_train_end(self) -> None:
        self.nonfinite_guard.check(self.trainer)  # the steps after the last metrics read
        self.nonfinite_guard.summarise(self.trainer, self.settings.optim.lr)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self.step(batch, max(self.settings.metrics.topk), self.anchor_generator(batch, batch_idx))
        self.val_metrics.update(out)
        self.log("val/loss", out.loss, prog_bar=True, batch_size=1, sync_dist=True)  # epoch mean over ranks
        if self.loss_settings.distills:  # comparable across objectives
            self.log("val/ce", out.ce, batch_size=1, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val", self.val_metrics.compute())

    def _log_metrics(self, stage: str, values: dict[str, Tensor], loss: Tensor | None = None) -> Tensor:
        """Log metric values after one device-to-host copy, so later progress-bar reads never sync; returns them."""
        if loss is not None:
            values = {"loss": loss.detach(), **values}
        host = torch.stack([v.float() for v in values.values()]).cpu()
        shown = {"loss", "acc", "tau"}
        for (name, _), value in zip(values.items(), host, strict=True):
            self.log(f"{stage}/{name}", value, prog_bar=name in shown, batch_size=1)
        return host

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip, and make the fused optimizer skip the update on the device if the loss or the gradient norm is not
        finite (`clip_grad_norm`: through FSDP's own where the model has it)."""
        by_norm = gradient_clip_algorithm in (None, "norm")
        if gradient_clip_val and not by_norm:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        max_norm = float(gradient_clip_val) if gradient_clip_val and by_norm else math.inf
        norm = clip_grad_norm(self.trainer.model, optimizer, max_norm)
        self.nonfinite_guard.skip_if_nonfinite(optimizer, norm, self.trainer)

    def configure_optimizers(self) -> dict[str, Any]:
        optim = self.settings.optim
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            # fused (on the CPU too): one kernel per step on GPUs, and it skips non-finite steps on the device
            lr=optim.lr, betas=tuple(optim.betas), fused=True,
        )
        estimate = self.trainer.estimated_stepping_batches
        self.check_parts(float(estimate))
        if not math.isfinite(estimate):  # int(inf) would end the run in an OverflowError
            raise ConfigError("trainer.max_steps: the run has no end (max_steps -1, max_epochs -1 or unset), and the "
                              "learning rate's warmup and cosine decay are fractions of its total steps; set "
                              "trainer.max_steps or trainer.max_epochs")
        self._total_steps = float(estimate)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.schedule(max(1, int(estimate))))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if compat.attached_trainer(self) is not None and self.trainer.training:
            # A skipped step the host has not read yet (nonfinite: stop, or too many in a row) must stop the run
            # before a checkpoint records it as a later, trained step. One copy per save.
            self.nonfinite_guard.check(self.trainer)
        self.run_record.save(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of a run that trained something else, before its weights are loaded."""
        self._resumed = self.run_record.check(self, checkpoint)

    def on_train_start(self) -> None:
        self.nonfinite_guard.start(self.trainer.global_step)
        if self._resumed:  # loading the optimizer and scheduler restored the checkpoint's lr, betas and weight decay
            self.settings.optim.restore(self.optimizers(use_pl_optimizer=False), self.lr_schedulers())
