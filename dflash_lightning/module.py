"""The LightningModule that trains a DFlash drafter on packed, fixed-shape batches.

`configure_model` builds the drafter and its persistent step buffers, then compiles the drafter in
place; every training step copies the batch into those buffers, so shapes and addresses never change.
Checkpoints carry the run's settings record (resume.py), checked when a run resumes from them.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from dflash_lightning import lightning_compat as compat
from dflash_lightning.blocks import anchor_seed, base_slot_weights, block_labels, select_anchors, teacher_positions
from dflash_lightning.config import PART_SETTINGS, ConfigError, DrafterConfig, check_unused_parts, upgrade_record
from dflash_lightning.fp8 import Recipe, convert_linears, require_fp8
from dflash_lightning.long_runs import resume
from dflash_lightning.loss import LossSettings
from dflash_lightning.metrics import DraftMetrics
from dflash_lightning.model import DFlashDrafter, DraftOutput
from dflash_lightning.opd import OPDSettings, accept_mask, greedy_drafts, opd_loss, replay, slot_kls
from dflash_lightning.parts.base import RunSettings
from dflash_lightning.target_model import load_target_config, load_target_io, tokenizer_ids
from dflash_lightning.target_model.callback import TargetFeatures

BATCH_KEYS = ("input_ids", "position_ids", "doc_ids", "loss_mask")
STAGES = ("sft", "opd")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


class NonFiniteError(RuntimeError):
    """Training met a NaN/Inf loss or gradient norm under `nonfinite: stop`, or too many in a row under `skip`."""


class StepBuffers(nn.Module):
    """Persistent fixed-shape inputs of the training step (static addresses for CUDA graphs)."""

    def __init__(
        self, token_budget: int, feature_dim: int, slot_weights: Tensor, final_dim: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        t = token_budget
        self.register_buffer("input_ids", torch.zeros(t, dtype=torch.long), persistent=False)
        self.register_buffer("position_ids", torch.zeros(t, dtype=torch.long), persistent=False)
        self.register_buffer("doc_ids", torch.full((t,), -1, dtype=torch.int32), persistent=False)
        self.register_buffer("loss_mask", torch.zeros(t, dtype=torch.bool), persistent=False)
        self.register_buffer("features", torch.zeros(t, feature_dim, dtype=dtype), persistent=False)  # [T, K*H]
        self.register_buffer("slot_weights", slot_weights, persistent=False)  # [B]
        # The target's final normed hidden states, the teacher of distillation; absent for plain CE.
        final = torch.zeros(t, final_dim, dtype=dtype) if final_dim else None  # [T, H]
        self.register_buffer("final_hidden", final, persistent=False)

    def load(self, batch: dict[str, Tensor]) -> None:
        """Copy one packed batch in; a batch of another shape is refused with the field named."""
        keys = (*BATCH_KEYS, "features", *(("final_hidden",) if self.final_hidden is not None else ()))
        for key in keys:
            src = batch["context_features" if key == "features" else key]
            dst = getattr(self, key)
            if src.shape != dst.shape:
                raise ValueError(f"batch field '{key}' has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src, non_blocking=True)


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
        """
        Args:
            target: Hugging Face folder or hub id of the frozen target (linked from `target.path` in the CLI).
            drafter: Drafter shape, variant (a preset of parts) and each part's settings; sizes left unset are the
                target's.
            token_budget: Tokens per packed batch T (linked from `data.token_budget` in the CLI).
            num_anchors: Anchors (blocks) drafted per batch A; unused slots are masked out.
            lr: Peak AdamW learning rate.
            weight_decay: AdamW weight decay.
            betas: AdamW betas.
            warmup_ratio: Fraction of the steps spent in linear warmup before cosine decay.
            min_lr_ratio: Final learning rate as a fraction of `lr`.
            compile: Compile the drafter's layers and head loss in place after its buffers exist.
            compile_mode: torch.compile mode (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs").
            compile_cache_dir: Persistent compiler cache (sets TORCHINDUCTOR_CACHE_DIR); runs that share it skip
                the cold compile (33 s for the Qwen3-8B recipe on an H200, 5 s warm).
            metrics_every: Compute and log accuracy and acceptance metrics every N training batches.
            topk: Top-k accuracies to report; must include 1.
            head_chunk_size: Rows of the frozen head's logits made at once in the loss (rounded down to whole
                blocks, at least one).
            objective: `ce`: cross-entropy against the data tokens; `kl`: KL(target || drafter), distilling the
                target's own distribution through the same frozen head (needs the whole target forward);
                `ce+kl`: their sum (docs/method.md section 4c).
            loss_weights: Slot weights: `decay`, exp(-(k-1)/gamma); `dpace`, from each step's per-slot CE, how
                much the expected accepted length depends on each slot (docs/method.md section 4b).
            dpace_alpha: D-PACE smoothing alpha in [0, 1]: s_k = (1 - alpha) * q_k + alpha.
            temperature: Distillation temperature: KL of the softmaxes of logits / temperature, times
                temperature**2.
            init_from: Warm start: a drafter `.ckpt` or exported folder (ours or published) whose weights start this
                run. A drafter may start a run of another variant whose backbone is its own: the parts it lacks
                start at their initialisation (convolutions as the identity, so at step 0 the backbone computes
                what it did), head-only parts it has and the run lacks are dropped (logged). Ignored when a
                checkpoint is resumed.
            accept_target_change: Go on (with one logged line) where the checkpoint resumed or validated, or the
                feature cache read, was made with other target weights of the same config (a fine-tune): by default
                refused, as the drafter was trained for, or the features come from, the other weights.
            nonfinite: A step whose loss or gradient norm is NaN/Inf never updates the weights or the optimizer
                state (decided on the device). skip: count it (`train/skipped_steps`, read every `metrics_every`
                steps) and go on; stop: skip every update from then on and raise, naming the step and the batch's
                source records, at the next metrics read.
            max_nonfinite_in_a_row: Under `skip`, raise once this many steps in a row were skipped.
            fp8: FP8 matmuls on Hopper GPUs (torchao): `head` runs the frozen head's logits and hidden-state
                gradient in FP8, `all` also trains the drafter's linear layers in FP8 (over the same master weights).
            fp8_recipe: FP8 scaling of the drafter's linears (torchao's recipe names): `tensorwise`, `rowwise`,
                `rowwise_with_gw_hp` (the weight-gradient GEMM in bf16), or `rowwise_forward_only` (both backward
                GEMMs in bf16); the frozen head scales per tensor for `tensorwise`, else per row.
            stage: `sft`: supervised training on the data's blocks (the objective above); `opd`: Draft-OPD, on-policy
                refinement of the trained drafter `init_from` names (docs/opd.md): at each anchor the drafter's own
                block, the target's distributions given the draft's tokens, greedy verification's accept mask,
                forward KL on accepted slots and decayed reverse KL on rejected ones. Validation keeps the `sft`
                objective, so the stages compare. Recorded in checkpoints: a resume cannot switch it.
            opd: The `opd` stage's settings (gamma, lambda_acc, lambda_rej, replay, sft_weight).

        Anchors are drawn from a seed of each batch's place in the data stream (`batch["anchor_seed"]`, from
        `DFlashDataModule`), so a resumed run draws the same anchors as an uninterrupted one.
        """
        super().__init__()
        self.save_hyperparameters()
        # every value the user typed, before the target's config is read
        check_unused_parts(drafter)
        drafter.check()
        for ok, message in (
            (token_budget >= drafter.block_size,
             f"model.token_budget ({token_budget}) must be >= block_size ({drafter.block_size})"),
            (1 <= num_anchors <= token_budget, f"model.num_anchors must be in 1..token_budget ({token_budget}), got "
                                               f"{num_anchors}"),
            (0 < lr < math.inf, f"model.lr must be a finite number > 0, got {lr}"),
            (0 <= weight_decay < math.inf, f"model.weight_decay must be a finite number >= 0, got {weight_decay}"),
            (len(betas) == 2 and all(0 <= b < 1 for b in betas),
             f"model.betas must be two numbers in [0, 1), got {list(betas)}"),
            (0 <= warmup_ratio < 1, f"model.warmup_ratio must be in [0, 1) (a fraction of the steps), got "
                                    f"{warmup_ratio}"),
            (0 <= min_lr_ratio <= 1, f"model.min_lr_ratio must be in [0, 1] (a fraction of lr), got {min_lr_ratio}"),
            (compile_mode in COMPILE_MODES, f"model.compile_mode must be null or one of {COMPILE_MODES[1:]}, got "
                                            f"{compile_mode!r}"),
            (metrics_every >= 1, f"model.metrics_every must be >= 1, got {metrics_every}"),
            (1 in topk and min(topk) >= 1, f"model.topk must include 1 (plain accuracy) and hold k >= 1 only, got "
                                           f"{list(topk)}"),
            (head_chunk_size >= 1, f"model.head_chunk_size must be >= 1, got {head_chunk_size}"),
            (max_nonfinite_in_a_row >= 1, f"model.max_nonfinite_in_a_row must be >= 1, got {max_nonfinite_in_a_row}"),
        ):
            if not ok:
                raise ConfigError(message)
        try:
            self.loss_settings = LossSettings(objective, loss_weights, dpace_alpha, temperature)
        except ConfigError as err:
            raise ConfigError(f"model.{err}") from None
        for name, value, needs, now in (("dpace_alpha", dpace_alpha, "loss_weights=dpace", loss_weights == "dpace"),
                                        ("temperature", temperature, "objective=kl or ce+kl", objective != "ce")):
            if value != getattr(LossSettings, name) and not now:  # set, where nothing reads it
                raise ConfigError(f"model.{name}={value}: read only with model.{needs}, so ignored; set that, or drop "
                                  f"model.{name}")
        self.opd_settings = opd if isinstance(opd, OPDSettings) else OPDSettings(**opd)  # a dict from a checkpoint
        check_stage(stage, self.opd_settings, drafter, init_from)
        self.check_parts(cfg=drafter)  # each part's rules for the run's settings (the target is not needed)
        if init_from and not Path(init_from).exists():  # before any target or GPU work
            raise ConfigError(f"model.init_from: no drafter checkpoint or folder at '{init_from}'")
        if nonfinite not in ("skip", "stop"):
            raise ConfigError(f"model.nonfinite must be skip or stop, got {nonfinite!r}")
        self.drafter_config = drafter.resolved(load_target_config(target), *tokenizer_ids(target))
        cfg = self.drafter_config
        if max(topk) > cfg.vocab_size:
            raise ConfigError(f"model.topk: each k must be in 1..vocab_size ({cfg.vocab_size}), got {list(topk)}")
        self.train_metrics = DraftMetrics(cfg.block_size, topk, cfg.layout)
        self.val_metrics = DraftMetrics(cfg.block_size, topk, cfg.layout)
        # each part's own metrics (parts/base.py `Part.metric`), by the part's name
        self.train_part_metrics, self.val_part_metrics = (nn.ModuleDict(
            {p.name: m for p in cfg.preset.parts if (m := p.metric(cfg.block_size)) is not None}) for _ in range(2))
        self.drafter: DFlashDrafter | None = None
        self.buffers_: StepBuffers | None = None
        self._anchor_generator: torch.Generator | None = None
        self._run_record: dict[str, Any] | None = None
        self._resumed = False
        # On the device, so the step never waits for the host: [skipped steps, skipped in a row, step index of the
        # first skipped step (-1: none), steps seen] since this process started training.
        self.register_buffer("nonfinite_counts", torch.tensor([0, 0, -1, 0]), persistent=False)
        self._first_step = 0  # global step at which nonfinite_counts started counting
        self._recent_batches: deque[tuple[int, Tensor]] = deque(maxlen=4 * metrics_every)  # (step, sample ids)
        self._last_loss: Tensor | None = None
        self._total_steps: float | None = None  # the Trainer's, once the optimizer is configured

    def configure_model(self) -> None:
        """Build the drafter, attach the target's frozen embedding and head, make buffers, compile."""
        if self.drafter is not None:  # Lightning may call this more than once
            return
        cfg, hp = self.drafter_config, self.hparams
        if hp.fp8 != "none":
            trainer = compat.attached_trainer(self)
            self.check_device(trainer.strategy.root_device if trainer is not None else self.device)
        self.drafter = DFlashDrafter(cfg)
        self.drafter.head_chunk_size = hp.head_chunk_size
        self.drafter.loss_settings = self.loss_settings
        if hp.init_from:  # before FP8 conversion and compile; a resumed checkpoint's weights replace these
            warm_start(self.drafter, hp.init_from)
        if hp.fp8 == "all":
            convert_linears(self.drafter, hp.fp8_recipe)
        # Under bf16-mixed the weights stay fp32 (the masters); frozen tensors and inputs take the compute dtype.
        dtype = self._autocast_dtype()
        embed, head = load_target_io(hp.target)
        self.drafter.set_target_io(embed.to(dtype or embed.dtype), head.to(dtype or head.dtype))
        self.buffers_ = StepBuffers(
            hp.token_budget, cfg.num_context_layers * cfg.hidden_size,
            base_slot_weights(cfg.block_size, hp.loss_weights, cfg.loss_gamma, cfg.layout),
            cfg.hidden_size if self.needs_final_hidden else 0, dtype,
        )
        if hp.compile:
            if hp.compile_cache_dir:  # read by inductor at its first compile, which comes after this
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(hp.compile_cache_dir).resolve())
            self.drafter.compile_blocks(hp.compile_mode)

    def check_device(self, device: torch.device, precision: str | None = None, off: str | None = None) -> None:
        """Refuse settings the device or precision cannot run (FP8 off Hopper-class GPUs or outside bf16), before any
        target is loaded: `precision` is the Trainer's, given where the module is not attached to it yet; `off`: the
        flags a refusal names (the target's too, where it runs in FP8)."""
        if self.hparams.fp8 == "none":
            return
        if precision is None:
            precision = getattr(getattr(compat.attached_trainer(self), "precision_plugin", None), "precision", None)
        if precision not in (None, "bf16-mixed", "bf16-true"):  # FP8 matmuls return bf16
            raise ConfigError(f"model.fp8={self.hparams.fp8} needs trainer.precision bf16-mixed, not {precision}")
        require_fp8(device, f"model.fp8={self.hparams.fp8}", off)

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
        if self.hparams.fp8 != "none" and self.drafter.head_fp8 is None:  # once, on the device, in its final dtype
            self.drafter.use_fp8_head(self.hparams.fp8_recipe)
        buf = self.buffers_
        if self.hparams.compile and self.hparams.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # CUDA graph outputs of the last step may be overwritten
        buf.load(batch)
        anchors, valid = select_anchors(buf.loss_mask, buf.doc_ids, self.hparams.num_anchors, generator)
        return self.drafter(
            buf.features, buf.input_ids, buf.position_ids, buf.doc_ids, buf.loss_mask,
            anchors, valid, buf.slot_weights, topk, buf.final_hidden,
        )

    def check_parts(self, total_steps: float | None = None, cfg: DrafterConfig | None = None) -> None:
        """Each part of the preset checks the run's settings (`Part.check_run`): when the module is built (`cfg`, the
        drafter as given, before the target is read), and with the Trainer's total steps when fitting starts."""
        cfg, loss = cfg or self.drafter_config, self.loss_settings
        final = loss.distills or any(p.needs_final_hidden for p in cfg.preset.parts)
        run = RunSettings(loss.objective, loss.loss_weights, cfg.loss_gamma, cfg.gamma is not None, final,
                          total_steps)
        for part in cfg.preset.parts:
            part.check_run(getattr(cfg, part.name), run)

    @property
    def needs_final_hidden(self) -> bool:
        """Whether training reads the target's final hidden states: the objective distills, a part needs them, or
        the stage is `opd` (the teacher of every slot, and a whole target to replay)."""
        return (self.loss_settings.distills or self.hparams.stage == "opd"
                or any(p.needs_final_hidden for p in self.drafter_config.preset.parts))

    @property
    def replays(self) -> bool:
        """Whether each training step runs the target on the drafts (`model.stage=opd` with `model.opd.replay`)."""
        return self.hparams.stage == "opd" and self.opd_settings.replay

    def final_hidden_reason(self) -> str:
        """The setting that makes training read the target's final hidden states, named for an error line."""
        if self.hparams.stage == "opd":
            return "model.stage 'opd'"
        if self.loss_settings.distills:
            return f"model.objective '{self.hparams.objective}'"
        return f"model.drafter.variant '{self.drafter_config.variant}'"

    def update_metrics(self, out: DraftOutput, stage: str) -> None:
        """Feed one forward's results to the stage's metrics: the backbone's and each part's."""
        base, parts = (self.train_metrics, self.train_part_metrics) if stage == "train" else (
            self.val_metrics, self.val_part_metrics)
        base.update(out.topk, out.labels, out.supervised)
        for name, metric in parts.items():
            metric.update(out.parts[name].rows, out.labels, out.supervised)

    def compute_metrics(self, stage: str) -> dict[str, Tensor]:
        """The stage's metric values (the backbone's, then each part's), and reset them."""
        base, parts = (self.train_metrics, self.train_part_metrics) if stage == "train" else (
            self.val_metrics, self.val_part_metrics)
        values = base.compute()
        base.reset()
        for metric in parts.values():
            values |= metric.compute()
            metric.reset()
        return values

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
        measure = batch_idx % self.hparams.metrics_every == 0
        if "sample_ids" in batch:  # kept (on the device, no copy) to name a bad batch's records later
            self._recent_batches.append((self.trainer.global_step, batch["sample_ids"]))
        trainer = compat.attached_trainer(self)
        for part in self.drafter.parts:  # what changes over the run (a curriculum), as device tensors in place
            part.set_step(trainer.global_step if trainer is not None else 0, self._total_steps)
        if self.hparams.stage == "opd":
            return self.opd_training_step(batch, measure, self.anchor_generator(batch, batch_idx))
        out = self.step(batch, max(self.hparams.topk) if measure else 0, self.anchor_generator(batch, batch_idx))
        self._last_loss = out.loss.detach()
        if measure:  # logging only here keeps host syncs off the other steps
            self.update_metrics(out, "train")
            counts = self.nonfinite_counts
            extra = {"ce": out.ce} if self.loss_settings.distills else {}
            for part in out.parts.values():
                extra |= part.logs
            values = {**extra, **self.compute_metrics("train"), "skipped_steps": counts[0],
                      "skipped_in_a_row": counts[1]}
            host = self._log_metrics("train", values, out.loss)
            self._check_nonfinite(*host[-2:].long().tolist())
        return out.loss

    def opd_training_step(self, batch: dict[str, Tensor], measure: bool, generator: torch.Generator) -> Tensor:
        """The `opd` stage's step: its loss, logged with its parts (and the rollout's seconds) on measured steps."""
        loss, logs = self.opd_step(batch, generator, self._replay_target() if self.replays else None, measure)
        self._last_loss = loss.detach()
        if measure:
            counts = self.nonfinite_counts
            host = self._log_metrics("train", {**logs, "skipped_steps": counts[0], "skipped_in_a_row": counts[1]},
                                     loss)
            self._check_nonfinite(*host[-2:].long().tolist())
        return loss

    def opd_step(self, batch: dict[str, Tensor], generator: torch.Generator | None = None,
                 target: Any = None, timed: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
        """Draft-OPD's loss of one packed batch (docs/opd.md) and its logs: the drafter's greedy block at each anchor,
        the target's distribution at each slot (`target`, a FeatureExtractor: replayed on the drafts; None: the
        row's own `final_hidden`), the accept mask, the acceptance-aware loss. `timed`: the rollout's seconds are
        exact (a GPU is synchronised for them)."""
        if "context_features" not in batch or "final_hidden" not in batch:
            raise RuntimeError("model.stage 'opd' needs 'context_features' and 'final_hidden' in each batch: add the "
                               "TargetFeatures callback (a feature cache must be written with --final_hidden true)")
        buf, drafter, hp = self.buffers_, self.drafter, self.hparams
        buf.load(batch)
        cfg, chunk = drafter.config, hp.head_chunk_size
        B, layout = cfg.block_size, cfg.layout
        anchors, valid = select_anchors(buf.loss_mask, buf.doc_ids, hp.num_anchors, generator)
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
        blocks = valid.sum().clamp_min(1)
        logs |= {"opd/tau": 1 + (accepted & supervised).sum() / blocks,  # greedy verification's, on-policy
                 "opd/rollout_s": torch.tensor(rollout, device=loss.device),  # beside device values: one copy
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
        self._check_nonfinite()  # the steps after the last metrics read
        self._summarise_steps()

    def _summarise_steps(self) -> None:
        """One line on the steps this process trained and skipped; more than half of them skipped fails the run (after
        its last checkpoint): its drafter barely trained, though no rule above stopped it."""
        skipped, _, first, seen = self.nonfinite_counts.tolist()
        if not seen:
            return
        start = self._first_step
        line = (f"steps {start}..{start + seen - 1} of this fit: {seen - skipped} trained, {skipped} skipped as "
                "non-finite")
        if skipped:
            line += f" (the first at step {start + first})"
        if 2 * skipped > seen:
            raise NonFiniteError(
                f"{line}: more than half, so the drafter barely trained; lower model.lr ({self.hparams.lr:g}) or "
                f"look at the records of step {start + first}: {self._batch_sources(start + first)}"
            )
        rank_zero_info(line)

    def _check_nonfinite(self, skipped: int | None = None, in_a_row: int | None = None) -> None:
        """Raise `NonFiniteError` as `nonfinite` says, from counts the host already has (else one copy)."""
        if skipped is None or in_a_row is None:
            skipped, in_a_row = self.nonfinite_counts[:2].tolist()
        stop = self.hparams.nonfinite == "stop" and skipped > 0
        if not stop and in_a_row < self.hparams.max_nonfinite_in_a_row:
            return
        _, _, first, seen = self.nonfinite_counts.tolist()
        if stop:
            step = self._first_step + first
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {step} (nonfinite: stop): neither it nor a later update "
                f"was applied; batch records: {self._batch_sources(step)}"
            )
        last = self._first_step + seen - 1
        raise NonFiniteError(
            f"{in_a_row} steps in a row, through step {last}, had a non-finite loss or gradient norm and were skipped "
            f"(max_nonfinite_in_a_row: {self.hparams.max_nonfinite_in_a_row}); last batch records: "
            f"{self._batch_sources(last)}"
        )

    def _batch_sources(self, step: int) -> str:
        """The file:line (or file:row N) of each record of the batch trained at `step`, if it is still known."""
        ids = next((t for s, t in reversed(self._recent_batches) if s == step), None)
        datamodule = getattr(self.trainer, "datamodule", None)
        if ids is None or not hasattr(datamodule, "train_locations"):
            return "unknown (not among the recent batches)"
        return ", ".join(datamodule.train_locations([i for i in ids.tolist() if i >= 0]))

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self.step(batch, max(self.hparams.topk), self.anchor_generator(batch, batch_idx))
        self.update_metrics(out, "val")
        self.log("val/loss", out.loss, prog_bar=True, batch_size=1, sync_dist=True)  # epoch mean over ranks
        if self.loss_settings.distills:  # comparable across objectives
            self.log("val/ce", out.ce, batch_size=1, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val", self.compute_metrics("val"))

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
        finite. By norm through FSDP's own `clip_grad_norm_` (the norm over all shards) where the model has it."""
        by_norm = gradient_clip_algorithm in (None, "norm")
        if gradient_clip_val and not by_norm:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        max_norm = float(gradient_clip_val) if gradient_clip_val and by_norm else math.inf
        wrapped = self.trainer.model
        if hasattr(wrapped, "clip_grad_norm_"):
            norm = wrapped.clip_grad_norm_(max_norm)  # Lightning's own norm clipping refuses FSDP
        else:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)  # equal on all DDP ranks
            if max_norm < math.inf:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        self._skip_if_nonfinite(optimizer, norm)

    def _skip_if_nonfinite(self, optimizer: torch.optim.Optimizer, grad_norm: Tensor) -> None:
        """Sets the fused optimizer's `found_inf` (as GradScaler does): a 1 skips the update, moments and step count."""
        bad = ~torch.isfinite(grad_norm.to(self.nonfinite_counts.device))
        if self._last_loss is not None:
            loss_bad = (~torch.isfinite(self._last_loss)).to(torch.int32)
            if self.trainer.world_size > 1:
                torch.distributed.all_reduce(loss_bad, op=torch.distributed.ReduceOp.MAX)  # every rank skips alike
            bad = bad | loss_bad.bool()
        counts, hit = self.nonfinite_counts, bad.long()
        counts[0] += hit
        counts[1] = (counts[1] + 1) * hit
        counts[2] = torch.where((counts[2] < 0) & bad, counts[3], counts[2])
        counts[3] += 1
        if self.hparams.nonfinite == "stop":
            bad = bad | (counts[2] >= 0)  # after the first bad step nothing is applied until the host raises
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        optimizer.found_inf = bad.to(torch.float32)  # 0-dim, like the optimizer's step counts

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            # fused (on the CPU too): one kernel per step on GPUs, and it skips non-finite steps on the device
            lr=hp.lr, betas=tuple(hp.betas), fused=True,
        )
        estimate = self.trainer.estimated_stepping_batches
        self.check_parts(float(estimate))
        if not math.isfinite(estimate):  # int(inf) would end the run in an OverflowError
            raise ConfigError("trainer.max_steps: the run has no end (max_steps -1, max_epochs -1 or unset), and the "
                              "learning rate's warmup and cosine decay are fractions of its total steps; set "
                              "trainer.max_steps or trainer.max_epochs")
        self._total_steps = float(estimate)
        total = max(1, int(estimate))
        warmup = int(hp.warmup_ratio * total)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if compat.attached_trainer(self) is not None and self.trainer.training:
            # A skipped step the host has not read yet (nonfinite: stop, or too many in a row) must stop the run
            # before a checkpoint records it as a later, trained step. One copy per save.
            self._check_nonfinite()
        # The resolved drafter config lets export and evaluation work without re-reading the target.
        checkpoint["drafter_config"] = self.drafter_config.to_dict()
        checkpoint[resume.RECORD_KEY] = self.run_record()
        if compat.attached_trainer(self) is not None:  # export serves the drafter in the dtype it was trained in
            checkpoint["precision"] = str(self.trainer.precision)

    def run_record(self) -> dict[str, Any]:
        """This run's settings as a checkpoint records them (made once: the target is fingerprinted)."""
        trainer = compat.attached_trainer(self)
        if self._run_record is None or trainer is None:  # data and layout are known once in a Trainer
            record = resume.run_record(self)
            if trainer is None:
                return record
            self._run_record = record
        return self._run_record

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of a run that trained something else, before its weights are loaded.

        On another number of ranks (the global batch kept) the loop's per-rank batch counts are rescaled.
        """
        trainer = compat.attached_trainer(self)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        saved = upgrade_record(checkpoint.get(resume.RECORD_KEY))  # an older version's flat part fields moved
        if isinstance(checkpoint.get("drafter_config"), dict):
            checkpoint["drafter_config"] = DrafterConfig.from_dict(checkpoint["drafter_config"]).to_dict()
        path = getattr(trainer, "ckpt_path", None)
        if saved is not None:
            saved = {"model.stage": "sft", **saved}  # written before stages: supervised
            if fitting and saved["model.stage"] != self.hparams.stage:
                raise resume.ResumeError(
                    f"cannot resume from {path}: its run trained stage {saved['model.stage']!r}, this one is "
                    f"{self.hparams.stage!r}; a new stage starts from the last one's weights in a new run folder, "
                    f"with --model.init_from={path}")
        resume.check_resume(saved, self.run_record(), path, fitting, self.hparams.accept_target_change)
        resume.check_weights(checkpoint, self.state_dict(), self.drafter_config.to_dict(), path)
        if fitting and saved is not None:
            resume.check_step_boundary(checkpoint, path)
            old_world = saved.get("trainer.world_size", trainer.world_size)
            resume.rescale_loop_progress(checkpoint, old_world, trainer.world_size)
        self._resumed = fitting

    def on_train_start(self) -> None:
        self.nonfinite_counts.copy_(torch.tensor([0, 0, -1, 0]))
        self._first_step = self.trainer.global_step
        if self._resumed:  # loading the optimizer and scheduler restored the checkpoint's values of these
            self._apply_optimizer_settings()

    def _apply_optimizer_settings(self) -> None:
        """Set lr, betas and weight decay to this run's values; the schedule's position is the checkpoint's."""
        hp = self.hparams
        optimizer = self.optimizers(use_pl_optimizer=False)
        scheduler = self.lr_schedulers()
        for group, decay in zip(optimizer.param_groups, (hp.weight_decay, 0.0), strict=True):
            group.update(betas=tuple(hp.betas), weight_decay=decay, initial_lr=hp.lr)
        scheduler.base_lrs = [hp.lr] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = hp.lr * factor(scheduler.last_epoch)  # what LambdaLR computes, with this run's lr
        compat.set_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])


def check_stage(stage: str, opd: OPDSettings, drafter: DrafterConfig, init_from: str | None) -> None:
    """Refuse, before any target or GPU work, a stage and its settings that cannot train together: `opd` settings
    without the stage, the stage without a trained drafter, or a variant whose parts cannot be trained on-policy
    (`Part.opd_refusal`, which says why)."""
    if stage not in STAGES:
        raise ConfigError(f"model.stage must be one of {STAGES}, got {stage!r}")
    opd.check()
    if stage != "opd":
        if opd != OPDSettings():
            raise ConfigError(f"model.opd: read only with model.stage=opd (the stage is {stage!r}), so ignored; set "
                              "--model.stage=opd, or drop model.opd")
        return
    if not init_from:
        raise ConfigError("model.stage=opd refines a trained drafter: name it with model.init_from (a .ckpt or "
                          "exported folder of the supervised stage)")
    for part in drafter.preset.parts:
        if part.opd_refusal:
            raise ConfigError(f"model.stage=opd: variant {drafter.variant!r} is not trained on-policy here: its "
                              f"{part.name} part {part.opd_refusal} (docs/opd.md)")


def warm_start(drafter: DFlashDrafter, path: str) -> None:
    """Load a drafter `.ckpt` or folder's weights into `drafter`, of the same variant or another on the same backbone.

    The source's config must be the drafter's in every shape field of the backbone and of the parts both have.
    Parts the drafter has and the source lacks keep their initialisation; parts the source has and the drafter
    lacks are dropped (logged) if they leave the backbone as it is (a head), else refused (convolutions).
    """
    from dflash_lightning.export import read_drafter

    mine = drafter.config
    cfg, state, _ = read_drafter(path, mine.num_target_layers)
    theirs, ours = set(cfg.preset.parts), set(mine.preset.parts)
    unshared = set(PART_SETTINGS) - {p.name for p in theirs & ours}  # settings of a part not in both: unread
    skip = {"variant", *cfg.training_fields(), *mine.training_fields()}
    flat = mine.flat_dict()
    diff = [k for k, v in cfg.flat_dict().items()
            if k not in skip and k.split(".")[0] not in unshared and v != flat.get(k)]
    if diff:
        raise ConfigError(f"model.init_from '{path}': its drafter differs from this run's in {', '.join(diff)}")
    only_theirs = [p for p in cfg.preset.parts if p not in ours]  # in preset order: messages repeat
    lost = [p for p in only_theirs if p.changes_backbone]
    if lost:
        raise ConfigError(f"model.init_from '{path}': a {cfg.variant} drafter cannot start a {mine.variant} run: "
                          f"its {', '.join(p.name for p in lost)} part(s) change the backbone this run lacks")
    if theirs == ours:
        drafter.load_state_dict(state)
        return
    dropped = [k for k in state if any(p.owns(k) for p in only_theirs)]
    kept = {k: v for k, v in state.items() if k not in dropped}
    missing, unexpected = drafter.load_state_dict(kept, strict=False)
    fresh = [p for p in drafter.parts if type(p) in ours - theirs]
    extra = [k for k in missing if not any(p.owns(k) for p in fresh)]
    if unexpected or extra:
        raise ConfigError(f"model.init_from '{path}': unexpected keys {unexpected}, missing {extra}")
    # the backbone's weights fit either layout; that its slots were trained to predict other positions is said
    words = {False: "fill-in", True: "anchor-first"}
    theirs_first, mine_first = cfg.layout.anchor_first, mine.layout.anchor_first
    relayout = "" if theirs_first == mine_first else (
        f"; its backbone was trained on {words[theirs_first]} blocks, this run's are {words[mine_first]}")
    if dropped:
        rank_zero_info(f"model.init_from '{path}': the {cfg.variant} drafter's "
                       f"{', '.join(p.name for p in only_theirs)} weights are not used by this "
                       f"{mine.variant} run ({len(dropped)} tensors){relayout}")
    elif relayout:
        rank_zero_info(f"model.init_from '{path}': a {cfg.variant} drafter starts this {mine.variant} run{relayout}")
