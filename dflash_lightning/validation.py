"""Real speculative decoding during `fit` (issue: served tau must be seen beside the training estimate).

Every `every_n_steps` the drafter drafts for the full target on a few held-out prompts; the measured
acceptance length is logged as `val/tau_served` next to `train/tau`, so a train/serve gap shows early.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from dflash_lightning.target import DTYPES, resolve_model_dir


class SpeculativeValidation(Callback):
    """Measures served tau by greedy speculative decoding with the full target, on global rank 0."""

    def __init__(
        self,
        prompts: str | None = None,
        every_n_steps: int = 0,
        num_prompts: int = 8,
        max_new_tokens: int = 128,
        target: str = "",
        dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
        enable_thinking: bool = False,
    ) -> None:
        """
        Args:
            prompts: JSONL of held-out prompts (`messages` or `prompt`, optional `category`); None: off.
            every_n_steps: Run every N optimizer steps (and at the end of fit); 0: off.
            num_prompts: Prompts decoded each time.
            max_new_tokens: Most tokens generated per prompt.
            target: Target folder or hub id (linked from `target.path` in the CLI).
            dtype: Dtype of the full target used for verification.
            enable_thinking: Chat-template flag of thinking models; drafters are trained with it off.
        """
        self.prompts_path, self.every, self.num_prompts = prompts, every_n_steps, num_prompts
        self.max_new_tokens, self.target, self.dtype = max_new_tokens, target, dtype
        self.enable_thinking = enable_thinking
        self.enabled = bool(prompts) and every_n_steps > 0
        self.model = self.tokenizer = self.prompts = None
        self.last_step = -1
        if self.enabled:
            from dflash_lightning.evaluate import read_prompts

            self.prompts = read_prompts(prompts, num_prompts)  # a bad file fails before any training

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.enabled and trainer.global_step % self.every == 0 and trainer.global_step > 0:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.enabled:
            self.run(trainer, pl_module, log=False)

    def run(self, trainer: Trainer, pl_module: LightningModule, log: bool = True) -> dict[str, Any] | None:
        """Decode the prompts once and log tau; other ranks do nothing (no collective is involved)."""
        if not trainer.is_global_zero or trainer.global_step == self.last_step:
            return None
        self.last_step = trainer.global_step
        from dflash_lightning.evaluate import evaluate

        drafter = pl_module.drafter
        if self.model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            folder = resolve_model_dir(self.target)
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[self.dtype]).to(pl_module.device)
            self.model.requires_grad_(False).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        with torch.no_grad(), torch.autocast(pl_module.device.type, enabled=False):
            report = evaluate(drafter, self.model, self.tokenizer, self.prompts, self.max_new_tokens,
                              enable_thinking=self.enable_thinking, progress=False, warmup=False)
        if log and report["tau_pooled"] is not None:  # CPU tensors: a float would be a device tensor read with a sync
            # tau pooled over all decode steps, and the mean of per-prompt tau (DFLASH.md section 6)
            pl_module.log("val/tau_served", torch.tensor(float(report["tau_pooled"])), rank_zero_only=True,
                          prog_bar=True)
            pl_module.log("val/tau_served_prompt_mean", torch.tensor(float(report["tau_prompt_mean"])),
                          rank_zero_only=True)
            pl_module.log("val/speculative_mismatches", torch.tensor(float(report["mismatches"])), rank_zero_only=True)
        self.report = report
        return report
