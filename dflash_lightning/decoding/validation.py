"""Real speculative decoding during `fit` (issue: served tau must be seen beside the training estimate).

Every `every_n_steps` the drafter drafts for the full target on a few held-out prompts; the measured
acceptance length is logged as `val/tau_served` next to `train/tau`, so a train/serve gap shows early
(when sampling, as `val/tau_served_t<temperature>` beside the expected `val/tau_expected_t<temperature>`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from dflash_lightning.errors import ConfigError
from dflash_lightning.fp8 import without_fp8
from dflash_lightning.hf.modeling_dflash import check_sampling
from dflash_lightning.target_model import DTYPES, resolve_model_dir


class SpeculativeValidation(Callback):
    """Measures served tau by speculative decoding (greedy, or sampled) with the full target, on global rank 0."""

    def __init__(
        self,
        prompts: str | None = None,
        every_n_steps: int = 0,
        num_prompts: int = 8,
        max_new_tokens: int = 128,
        target: str = "",
        dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
        enable_thinking: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
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
            temperature: Sampling temperature of the decoding; 0: greedy (`val/tau_served`), else speculative
                sampling logged as `val/tau_served_t<temperature>` and `val/tau_expected_t<temperature>`.
            top_p: Nucleus sampling threshold when sampling; 1: off.
            top_k: Sample among the k most likely tokens only; 0: off.
            seed: Seed of the random streams when sampling, the same at every run (comparable runs).
        """
        # before any training; the fields named as the command line names them
        for ok, message in ((every_n_steps >= 0, f"every_n_steps must be >= 0 (0: off), got {every_n_steps}"),
                            (num_prompts >= 1, f"num_prompts must be >= 1, got {num_prompts}"),
                            (max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"),
                            (math.isfinite(temperature), f"temperature must be finite, got {temperature}")):
            if not ok:
                raise ConfigError(f"spec_eval.{message}")
        try:
            check_sampling(temperature, top_p, top_k)
        except ValueError as err:
            raise ConfigError(f"spec_eval.{err}") from None
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        self.prompts_path, self.every, self.num_prompts = prompts, every_n_steps, num_prompts
        self.max_new_tokens, self.target, self.dtype = max_new_tokens, target, dtype
        self.enable_thinking = enable_thinking
        self.enabled = bool(prompts) and every_n_steps > 0
        self.model = self.tokenizer = self.prompts = None
        self.last_step = -1
        if self.enabled:
            from dflash_lightning.decoding.evaluate import read_prompts

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
        from dflash_lightning.decoding.evaluate import evaluate

        drafter = without_fp8(pl_module.drafter)  # decoded as served: plain linears over the same weights
        if self.model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            folder = resolve_model_dir(self.target)
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[self.dtype]).to(pl_module.device)
            self.model.requires_grad_(False).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        with torch.no_grad(), torch.autocast(pl_module.device.type, enabled=False):
            report = evaluate(drafter, self.model, self.tokenizer, self.prompts, self.max_new_tokens,
                              enable_thinking=self.enable_thinking, progress=False, warmup=False, **self.sampling)
        if log and report["tau_pooled"] is not None:  # CPU tensors: a float would be a device tensor read with a sync
            for name, value in self.metrics(report).items():
                pl_module.log(name, torch.tensor(float(value)), rank_zero_only=True,
                              prog_bar=name.startswith("val/tau_served"))
        self.report = report
        return report

    def metrics(self, report: dict[str, Any]) -> dict[str, float]:
        """What a run logs: greedy `val/tau_served` and mismatches; sampled, names that carry the temperature."""
        t = self.sampling["temperature"]
        if t == 0:
            # tau pooled over all decode steps, and the mean of per-prompt tau (docs/method.md section 6)
            return {"val/tau_served": report["tau_pooled"], "val/tau_served_prompt_mean": report["tau_prompt_mean"],
                    "val/speculative_mismatches": report["mismatches"]}
        return {f"val/tau_served_t{t:g}": report["tau_pooled"],
                f"val/tau_expected_t{t:g}": report["expected_tau_pooled"]}
