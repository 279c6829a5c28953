"""`python -m dflash_lightning evaluate`: served tau and speedup by real speculative decoding on held-out prompts.

The arguments are `evaluate_drafter`'s parameters; their help is its docstring. It loads the drafter and the target
(`load_served`, which `calibrate` shares), runs `decoding.evaluate.evaluate` per temperature and writes report.json
and report.png (`pictures.figures`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import auto_cli

from dflash_lightning.decoding.calibration import fits_for, fold, read_calibration
from dflash_lightning.decoding.evaluate import evaluate, parse_temperatures, print_summary, read_prompts
from dflash_lightning.hf.modeling_dflash import check_sampling
from dflash_lightning.long_runs.atomic import write_atomic
from dflash_lightning.parts.base import ServedSettings, VerifyCost

DEFAULT_COST = VerifyCost()
"""The cost model `evaluate` weighs adaptive verification by unless told."""


def load_served(drafter: str, target: str | None, device: str, dtype: str) -> tuple[Any, Any, Any, Any, str, str]:
    """(the drafter as served, with the target's embedding and head; its weights as read; the target model; its
    tokenizer; the target's name; the device) of a `.ckpt` or exported folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_lightning.folder.reader import build_drafter, read_drafter
    from dflash_lightning.target_model import DTYPES, load_target_config, resolve_model_dir

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # the target's layer count, for a drafter folder that does not record it (speculators' own)
    layers = load_target_config(str(resolve_model_dir(target, "--target"))).num_hidden_layers if target else None
    cfg, state, ckpt_target = read_drafter(drafter, layers)
    target = target or ckpt_target
    if target is None:
        raise ValueError("--target is needed for an exported drafter folder")
    folder = resolve_model_dir(target, "--target")
    model = build_drafter(cfg, state, target, dtype).to(device)  # cast as engines cast, overflow refused
    target_model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, state, target_model, tokenizer, str(target), device


def evaluate_drafter(
    *,
    drafter: str,
    prompts: str,
    target: str | None = None,
    out: str = "eval",
    max_new_tokens: int = 256,
    num_prompts: int | None = None,
    device: str = "auto",
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
    enable_thinking: bool = False,
    temperature: str | float = "0",
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    verify_cost: VerifyCost = DEFAULT_COST,
    calibration: str | None = None,
    baseline: Literal["all", "greedy"] = "all",
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Measure a drafter by speculative decoding against the target alone; write report.json and report.png.

    report.json holds the report of `evaluate` for the first temperature asked (greedy by default) at the top, and
    every temperature's, the first one's again, under `per_temperature` (keys as typed: "0", "0.6"). The copy is
    deliberate: the top level is the one-run format that one-run readers take (benchmarks, notebooks/evaluate.ipynb).

    Args:
        drafter: Lightning `.ckpt` of a DFlashModule, or an exported Hugging Face drafter folder.
        prompts: JSONL file of prompts, `{"messages": [...]}` or `{"prompt": "..."}`, optional `"category"`.
        target: Target model folder or hub id; None: the one named in the checkpoint.
        out: Folder for report.json and report.png.
        max_new_tokens: Most tokens generated per prompt.
        num_prompts: Evaluate only the first N prompts; None: all.
        device: Device of target and drafter; auto: cuda if available.
        dtype: Dtype of target and drafter.
        enable_thinking: Chat-template flag of thinking models (Qwen3); DFlash drafters are trained with it off.
        temperature: Sampling temperature(s), comma-separated (`0,0.6,1`): a report per temperature; 0 is greedy.
        top_p: Nucleus sampling: keep the smallest most likely set of tokens reaching this probability; 1: off.
        top_k: Sample among the k most likely tokens only; 0: off.
        seed: Seed of the random streams when sampling; the same seed gives the same tokens and tau.
        verify_cost: The cost model of a decode step that parts' served reports weigh adaptive verification by
            (DSpark's: what vLLM's and SGLang's rule would verify and accept).
        calibration: calibration.json of `calibrate` (on other prompts): the parts report their served confidences
            under its fit for each temperature as well as raw (DSpark: survival ECE, AUROC, and the engines'
            adaptive verification with SGLang's per-slot temperatures and vLLM's folded head). Every temperature
            asked for must have a fit, made for this drafter.
        baseline: Where the target also decodes alone: `all` temperatures (speedup everywhere), or `greedy`
            only (the mismatch check; sampled temperatures report tau but no speedup, at half the time).
        batch_size: Prompts decoded together (the same tokens as one at a time); None: 16 on CUDA, 1 elsewhere. Above
            1 the speedup column is the ratio of throughputs at that batch, not a latency: benchmarks/decode_speed.py
            measures batch-1 tokens per second.
    """
    from dflash_lightning.pictures.figures import report_figure

    temperatures = parse_temperatures(temperature)
    check_sampling(1.0, top_p, top_k)  # settings are refused before anything is loaded
    rows = read_prompts(prompts, num_prompts)
    fits = {t: None for t in temperatures}
    if calibration is not None:
        table = read_calibration(calibration)
        fits = {t: fits_for(table, t, calibration) for t in temperatures}
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
    model, state, target_model, tokenizer, target, device = load_served(drafter, target, device, dtype)
    batch_size = batch_size or (16 if torch.device(device).type == "cuda" else 1)
    for fit in fits.values():
        if fit is not None:  # a fit of another drafter is refused here, before any decoding
            fold(model.config.preset.parts, state, fit, calibration)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, t in enumerate(temperatures):
        runs.append(evaluate(model, target_model, tokenizer, rows, max_new_tokens, enable_thinking=enable_thinking,
                             warmup=i == 0, temperature=t, top_p=top_p, top_k=top_k, seed=seed,
                             served=ServedSettings(verify_cost, fits[t]), baseline=baseline == "all" or t == 0,
                             batch_size=batch_size))
        # The first temperature's report at the top, where one-run readers look; every one so far, that one too, by
        # temperature. Written after each temperature: a run cut short keeps the temperatures it finished.
        report = {**runs[0], "per_temperature": {f"{run['temperature']:g}": run for run in runs}}
        report.update(drafter=str(drafter), target=str(target), device=str(device), dtype=dtype,
                      calibration=calibration, complete=len(runs) == len(temperatures))
        write_atomic(out_dir / "report.json", partial(Path.write_text, data=json.dumps(report, indent=2) + "\n"))
    report_figure(runs).savefig(out_dir / "report.png", dpi=120)  # one series per temperature
    print_summary(runs)
    return report



def main(argv: Sequence[str] | None = None) -> None:
    """`python -m dflash_lightning evaluate --drafter X --prompts prompts.jsonl [--target T]`."""
    auto_cli(evaluate_drafter, args=None if argv is None else list(argv))


__all__ = ["evaluate_drafter", "main"]
