"""The LightningModule that trains a DFlash drafter on packed, fixed-shape batches.

`configure_model` builds the drafter and its persistent step buffers, then compiles the drafter in
place; every training step copies the batch into those buffers, so shapes and addresses never change.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from dflash_lightning.blocks import select_anchors, slot_weights
from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.metrics import DraftMetrics
from dflash_lightning.model import DFlashDrafter, DraftOutput
from dflash_lightning.target import load_target_config, load_target_io, tokenizer_ids

BATCH_KEYS = ("input_ids", "position_ids", "doc_ids", "loss_mask")


class StepBuffers(nn.Module):
    """Persistent fixed-shape inputs of the training step (static addresses for CUDA graphs)."""

    def __init__(self, token_budget: int, feature_dim: int, block_size: int, gamma: float) -> None:
        super().__init__()
        t = token_budget
        self.register_buffer("input_ids", torch.zeros(t, dtype=torch.long), persistent=False)
        self.register_buffer("position_ids", torch.zeros(t, dtype=torch.long), persistent=False)
        self.register_buffer("doc_ids", torch.full((t,), -1, dtype=torch.int32), persistent=False)
        self.register_buffer("loss_mask", torch.zeros(t, dtype=torch.bool), persistent=False)
        self.register_buffer("features", torch.zeros(t, feature_dim), persistent=False)  # [T, K*H]
        self.register_buffer("slot_weights", slot_weights(block_size, gamma), persistent=False)  # [B]

    def load(self, batch: dict[str, Tensor]) -> None:
        """Copy one packed batch in; a batch of another shape is refused with the field named."""
        for key in (*BATCH_KEYS, "features"):
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
    ) -> None:
        """
        Args:
            target: Hugging Face folder or hub id of the frozen target (linked from `target.path` in the CLI).
            drafter: Drafter shape; sizes left unset are the target's.
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
            head_chunk_size: Rows of the frozen head's logits made at once in the loss.
        """
        super().__init__()
        self.save_hyperparameters()
        self.drafter_config = drafter.resolved(load_target_config(target), *tokenizer_ids(target))
        cfg = self.drafter_config
        if token_budget < cfg.block_size:
            raise ConfigError(f"token_budget ({token_budget}) must be >= block_size ({cfg.block_size})")
        if not 1 <= num_anchors <= token_budget:
            raise ConfigError(f"num_anchors must be in 1..token_budget ({token_budget}), got {num_anchors}")
        if metrics_every < 1:
            raise ConfigError(f"metrics_every must be >= 1, got {metrics_every}")
        self.train_metrics = DraftMetrics(cfg.block_size, topk)
        self.val_metrics = DraftMetrics(cfg.block_size, topk)
        self.drafter: DFlashDrafter | None = None
        self.buffers_: StepBuffers | None = None

    def configure_model(self) -> None:
        """Build the drafter, attach the target's frozen embedding and head, make buffers, compile."""
        if self.drafter is not None:  # Lightning may call this more than once
            return
        cfg, hp = self.drafter_config, self.hparams
        self.drafter = DFlashDrafter(cfg)
        self.drafter.head_chunk_size = hp.head_chunk_size
        embed, head = load_target_io(hp.target)
        self.drafter.set_target_io(embed, head)
        self.buffers_ = StepBuffers(
            hp.token_budget, cfg.num_context_layers * cfg.hidden_size, cfg.block_size, cfg.loss_gamma
        )
        if hp.compile:
            if hp.compile_cache_dir:  # read by inductor at its first compile, which comes after this
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(hp.compile_cache_dir).resolve())
            self.drafter.compile_blocks(hp.compile_mode)

    def step(self, batch: dict[str, Tensor], topk: int = 0, generator: torch.Generator | None = None) -> DraftOutput:
        """Loss (and top-k ids) of one packed batch through the persistent buffers."""
        if "context_features" not in batch:
            raise RuntimeError("batch has no 'context_features': add the TargetFeatures callback to the Trainer")
        buf = self.buffers_
        if self.hparams.compile and self.hparams.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # CUDA graph outputs of the last step may be overwritten
        buf.load(batch)
        anchors, valid = select_anchors(buf.loss_mask, buf.doc_ids, self.hparams.num_anchors, generator)
        return self.drafter(
            buf.features, buf.input_ids, buf.position_ids, buf.doc_ids, buf.loss_mask,
            anchors, valid, buf.slot_weights, topk,
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        measure = batch_idx % self.hparams.metrics_every == 0
        out = self.step(batch, max(self.hparams.topk) if measure else 0)
        if measure:  # logging only here keeps host syncs off the other steps
            self.train_metrics.update(out.topk, out.labels, out.weights)
            self._log_metrics("train", self.train_metrics.compute(), out.loss)
            self.train_metrics.reset()
        return out.loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self.step(batch, max(self.hparams.topk))
        self.val_metrics.update(out.topk, out.labels, out.weights)
        self.log("val/loss", out.loss, prog_bar=True, batch_size=1, sync_dist=True)  # epoch mean over ranks

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val", self.val_metrics.compute())
        self.val_metrics.reset()

    def _log_metrics(self, stage: str, values: dict[str, Tensor], loss: Tensor | None = None) -> None:
        """Log metric values after one device-to-host copy, so later progress-bar reads never sync."""
        if loss is not None:
            values = {"loss": loss.detach(), **values}
        host = torch.stack([v.float() for v in values.values()]).cpu()
        shown = {"loss", "acc", "tau"}
        for (name, _), value in zip(values.items(), host, strict=True):
            self.log(f"{stage}/{name}", value, prog_bar=name in shown, batch_size=1)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by norm through FSDP's own `clip_grad_norm_` (the norm over all shards) where the model has it."""
        wrapped = self.trainer.model
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and hasattr(wrapped, "clip_grad_norm_"):
            wrapped.clip_grad_norm_(gradient_clip_val)  # Lightning's own norm clipping refuses FSDP
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas), fused=self.device.type == "cuda",  # one kernel per step on GPUs
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(hp.warmup_ratio * total)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The resolved drafter config lets export and evaluation work without re-reading the target.
        checkpoint["drafter_config"] = self.drafter_config.to_dict()
        if self._trainer is not None:  # export serves the drafter in the dtype it was trained in
            checkpoint["precision"] = str(self.trainer.precision)
