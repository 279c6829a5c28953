"""`python -m dflash_lightning calibrate`: fit a drafter's served confidences on prompts apart from the evaluation's.

The arguments are `calibrate_drafter`'s parameters; their help is its docstring. Per serving temperature it decodes
the prompts as `evaluate` does (the target alone is not run), hands the served blocks to each part that calibrates
(`Part.calibrate`: DSpark's per-slot temperatures and affine map) and writes calibration.json with the files the
parts add (SGLang's `sts-T<t>.json`), for `evaluate --calibration` and `export --calibration`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from jsonargparse import auto_cli

from dflash_lightning.commands.evaluate import load_served
from dflash_lightning.decoding.calibration import FORMAT
from dflash_lightning.decoding.evaluate import evaluate, parse_temperatures, read_prompts
from dflash_lightning.errors import ConfigError
from dflash_lightning.hf.modeling_dflash import check_sampling
from dflash_lightning.parts.base import calibrates


def calibrate_drafter(
    *,
    drafter: str,
    prompts: str,
    eval_prompts: str | None = None,
    target: str | None = None,
    out: str = "calibration",
    temperature: str | float = "0,1",
    max_new_tokens: int = 256,
    num_prompts: int | None = None,
    device: str = "auto",
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
    enable_thinking: bool = False,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """Fit a drafter's served confidences per serving temperature; write calibration.json and the engines' files.

    Serve the drafter (as `evaluate` decodes) on `prompts`, which must not be the evaluation's, and fit what its
    parts calibrate on the served blocks (DSpark: SGLang's per-slot temperatures, `sts-T<t>.json` for
    `--speculative-dspark-confidence-sts-path`, and an affine map of the confidence logit that
    `export --calibration` folds into the folder's `confidence_head.proj` for vLLM). Then measure it on the
    evaluation prompts with `evaluate --calibration out/calibration.json`.

    Args:
        drafter: Lightning `.ckpt` of a DFlashModule, or an exported (not yet calibrated) drafter folder.
        prompts: JSONL file of calibration prompts, `{"messages": [...]}` or `{"prompt": "..."}` (a training row's
            answer is dropped), apart from the evaluation prompts and best from conversations the drafter did
            not train on.
        eval_prompts: The evaluation prompts file: a prompt in both files is refused (calibrating on them would
            measure the calibration on its own data).
        target: Target model folder or hub id; None: the one named in the checkpoint.
        out: Folder for calibration.json and the parts' files.
        temperature: Serving temperature(s), comma-separated: one fit each (a calibration holds at the temperature
            it was fitted at); 0 is greedy.
        max_new_tokens: Most tokens generated per prompt.
        num_prompts: Use only the first N prompts; None: all.
        device: Device of target and drafter; auto: cuda if available.
        dtype: Dtype of target and drafter, as they are served.
        enable_thinking: Chat-template flag of thinking models (Qwen3).
        top_p: Nucleus sampling of the served temperatures above 0; 1: off.
        top_k: Sample among the k most likely tokens only; 0: off.
        seed: Seed of the random streams when sampling.
    """
    temperatures = parse_temperatures(temperature)
    check_sampling(1.0, top_p, top_k)
    rows = read_prompts(prompts, num_prompts)
    if eval_prompts is not None:
        check_apart(rows, prompts, read_prompts(eval_prompts), eval_prompts)
    model, state, target_model, tokenizer, target, device = load_served(drafter, target, device, dtype)
    parts = [part for part in model.config.preset.parts if calibrates(part)]
    if not parts:
        raise ConfigError(f"{drafter}: a {model.config.preset.architecture} has no part that calibrates (DSpark's "
                          f"confidence head does)")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    table: dict[str, Any] = {
        "format": FORMAT, "drafter": str(drafter), "target": target, "prompts": str(prompts),
        "num_prompts": len(rows), "max_new_tokens": max_new_tokens, "dtype": dtype,
        "sampling": {"top_p": top_p, "top_k": top_k, "seed": seed}, "per_temperature": {}}
    for i, t in enumerate(temperatures):
        run = evaluate(model, target_model, tokenizer, rows, max_new_tokens, enable_thinking=enable_thinking,
                       warmup=i == 0, temperature=t, top_p=top_p, top_k=top_k, seed=seed, baseline=False)
        entry: dict[str, Any] = {"temperature": t, "tau_pooled": run["tau_pooled"], "steps": run["steps"],
                                 "parts": {}}
        for part in parts:
            fitted = part.calibrate(run["prompts"], state)
            files = {}
            for name, text in fitted.files.items():
                stem, dot, suffix = name.rpartition(".")
                files[name] = f"{stem}-T{t:g}{dot}{suffix}" if dot else f"{name}-T{t:g}"
                (out_dir / files[name]).write_text(text)
            entry["parts"][part.name] = {"fit": fitted.fit, "report": fitted.report, "files": files}
            for line in fitted.lines:
                print(f"T {t:g}, {part.name}: {line}")
        table["per_temperature"][f"{t:g}"] = entry
    (out_dir / "calibration.json").write_text(json.dumps(table, indent=2) + "\n")
    print_next_steps(out_dir, table, drafter)
    return table


def prompt_key(row: dict[str, Any]) -> str:
    """A prompt row as served (`decoding.evaluate.prompt_ids`: the messages before a training row's answer)."""
    if "prompt" in row:
        return json.dumps([{"role": "user", "content": row["prompt"]}])
    messages = list(row["messages"])
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in messages])


def check_apart(rows: list[dict[str, Any]], source: str, others: list[dict[str, Any]], other_source: str) -> None:
    """Refuse calibration prompts that are also evaluation prompts, naming the first few by line."""
    seen = {prompt_key(row) for row in others}
    shared = [i + 1 for i, row in enumerate(rows) if prompt_key(row) in seen]
    if shared:
        lines = ", ".join(map(str, shared[:5])) + (f" and {len(shared) - 5} more" if len(shared) > 5 else "")
        raise ConfigError(f"{source}: prompts on lines {lines} are also in {other_source}: calibrate on prompts "
                          f"apart from the evaluation's")


def print_next_steps(out_dir: Path, table: dict[str, Any], drafter: str) -> None:
    """Where the files are and the commands that use them."""
    calibration = out_dir / "calibration.json"
    print(f"wrote {calibration}")
    for key, entry in table["per_temperature"].items():
        for name, part in entry["parts"].items():
            for file in part["files"].values():
                print(f"  T {key}, {name}: {out_dir / file}")
    first = next(iter(table["per_temperature"]))
    print(f"measure it on the evaluation prompts:\n  python -m dflash_lightning evaluate --drafter {drafter} "
          f"--prompts EVAL_PROMPTS --temperature {','.join(table['per_temperature'])} --calibration {calibration}")
    print(f"fold the fit of the temperature a folder is served at into it (vLLM):\n  python -m dflash_lightning export "
          f"--checkpoint {drafter} --out FOLDER --calibration {calibration} --calibration_temperature {first}")


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m dflash_lightning calibrate --drafter X --prompts calibration.jsonl --eval_prompts prompts.jsonl`."""
    auto_cli(calibrate_drafter, args=None if argv is None else list(argv))


__all__ = ["calibrate_drafter", "check_apart", "main", "prompt_key"]
