"""A/B of training recipes on the tiny default: served tau by real speculative decoding, over seeds.

Each run is `fit --config configs/tiny.yaml` with the recipe's settings and `--seed_everything=N`,
then `evaluate` of its last.ckpt on the 74 held-out prompts, as the README's first command does (its counting:
`tau_pooled` over all steps and `tau_prompt_mean`, docs/method.md section 6):

    python benchmarks/objective_ab.py --out benchmarks/results/tiny-objectives.json

Runs go one at a time by default, seed by seed (`--jobs N --threads M` runs N at once with M threads each, on
a machine with N * M free cores); a finished run is read, not redone, so an interrupted A/B resumes.
The DFlash / DFlash2 A/B (issue 24), sampled too, on a GPU (`--device cuda`: fit and evaluate there, in fp32):

    python benchmarks/objective_ab.py --recipes dpace-ce,dflash2-dpace-ce --temperatures 0,0.6,1 --device cuda \
        --out benchmarks/results/tiny-dflash2-ab.json

DSpark against DFlash2 at the tiny default's block size (issue 37; not yet run):

    python benchmarks/objective_ab.py --recipes dflash2-dpace-ce,dspark --temperatures 0,0.6,1 --device cuda \
        --out benchmarks/results/tiny-dspark-ab.json

XPress against DFlash2 and DSpark (issue 44; not yet run): `xpress` drafts as vLLM 0.34 serves it (the greedy Jacobi
block, point masses at T > 0), `xpress-gumbel` with the xPress harness's sampled drafts and their q at T > 0 (the same
at T 0), `xpress-prev0-anchor` trains with the anchor as prev_0, which is what vLLM feeds when it serves:

    python benchmarks/objective_ab.py --recipes dflash2-dpace-ce,dspark,xpress,xpress-gumbel,xpress-prev0-anchor \
        --temperatures 0,0.6,1 --seeds 0,1 --device cuda --out benchmarks/results/tiny-xpress-ab.json

Domino against DFlash2 and DSpark at the tiny default's block size (issue 44; not yet run):

    python benchmarks/objective_ab.py --recipes dflash2-dpace-ce,dspark,domino --temperatures 0,0.6,1 --device cuda \
        --out benchmarks/results/tiny-domino-ab.json

Features from an FP8 target against a bf16 one (issue 26), on a Hopper GPU:

    python benchmarks/objective_ab.py --recipes target-bf16,target-fp8 --device cuda --jobs 6 --threads 2 --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# each recipe: config keys, dotted as on the command line, over configs/tiny.yaml
DPACE = {"model.objective": "ce", "model.loss_weights": "dpace"}
TINY_LATTICE = {"model.drafter.lilicorr.hidden_size": 0, "model.drafter.lilicorr.factor_dim": 128}
B7 = {"model.drafter.block_size": 7, "model.drafter.gamma": 4.0}
XPRESS = {"model.objective": "ce", "model.loss_weights": "decay", "model.drafter.variant": "xpress"}
RECIPES = {
    "decay-ce": {"model.objective": "ce", "model.loss_weights": "decay"},
    "dpace-ce": {"model.objective": "ce", "model.loss_weights": "dpace"},
    "decay-kl": {"model.objective": "kl", "model.loss_weights": "decay"},
    "dpace-kl": {"model.objective": "kl", "model.loss_weights": "dpace"},
    "dflash2-dpace-ce": {"model.objective": "ce", "model.loss_weights": "dpace", "model.drafter.variant": "dflash2"},
    # DSpark (docs/dspark.md): its own loss (decay weights exp(-k/4), reads the target's final hidden states)
    "dspark": {"model.objective": "ce", "model.loss_weights": "decay", "model.drafter.variant": "dspark"},
    # XPress (docs/xpress.md): its own loss (decay weights exp(-(k-1)/4), reads the target's final hidden states)
    "xpress": XPRESS,
    "xpress-gumbel": {**XPRESS, "model.drafter.xpress.sampled_drafts": True},
    "xpress-prev0-anchor": {**XPRESS, "model.drafter.xpress.prev0": "anchor"},
    # Domino (docs/domino.md): its own loss (CE on the corrected and the base logits, lambda 1 -> 0 over the run,
    # decay weights exp(-k/7)); GRU and projector at ModelOpt's proportions to the width (1024 and 256 of 4096)
    "domino": {"model.objective": "ce", "model.loss_weights": "decay", "model.drafter.variant": "domino",
               "model.drafter.domino.gru_hidden_dim": 32, "model.drafter.domino.emb_dim": 8},
    # LiLiCorr (docs/lilicorr.md) with the lattice at the tiny drafter's width (the recipe's 1024 is 8x the drafter)
    "lilicorr-dpace-ce": {**DPACE, "model.drafter.variant": "lilicorr", **TINY_LATTICE},
    "lilicorr-conv-dpace-ce": {**DPACE, "model.drafter.variant": "lilicorr-conv", **TINY_LATTICE},
    # block 7 (DSpark's paper): gamma set, as block 7 has no default (D-PACE does not read it)
    "dflash2-b7": {**DPACE, "model.drafter.variant": "dflash2", **B7},
    "lilicorr-conv-b7": {**DPACE, "model.drafter.variant": "lilicorr-conv", **TINY_LATTICE, **B7},
    "dspark-b7": {"model.objective": "ce", "model.loss_weights": "decay", "model.drafter.variant": "dspark", **B7},
    # the features a drafter trains on from a bf16 or an FP8 target (Hopper GPUs), served by the same fp32 target
    "target-bf16": {"target.dtype": "bfloat16"},
    "target-fp8": {"target.dtype": "bfloat16", "target.fp8": True},
}
PROMPTS = "dflash_lightning/assets/tiny/data/prompts.jsonl"


def run_config(base: dict, run_dir: Path, seed: int, settings: dict, device: str = "cpu") -> dict:
    """The tiny config with the recipe's settings (dotted keys), the seed, the device, and every output under
    `run_dir`."""
    cfg = json.loads(json.dumps(base))  # deep copy
    cfg["seed_everything"] = seed
    for key, value in settings.items():
        *sections, name = key.split(".")
        node = cfg
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    trainer = cfg["trainer"]
    trainer["accelerator"] = "gpu" if device == "cuda" else "cpu"
    trainer["default_root_dir"] = str(run_dir)
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(run_dir)
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"]["dirpath"] = str(run_dir / "checkpoints")
    return cfg


def one_run(name: str, seed: int, work: Path, base: dict, config_name: str, threads: int | None = None,
            device: str = "cpu", temperatures: str = "0", extra: dict | None = None, prompts: str = PROMPTS,
            evaluate_args: tuple[str, ...] = ()) -> dict:
    """fit then evaluate one recipe and seed (or read the finished run); its figures. `extra`: settings (dotted keys)
    over every recipe's (a shared feature cache, the step count); `evaluate_args`: more `evaluate` options."""
    run_dir = work / f"{name}-seed{seed}"
    report_path = run_dir / "eval" / "report.json"
    record_path = run_dir / "run.json"
    if report_path.exists() and record_path.exists():
        return json.loads(record_path.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "config.yaml"
    config.write_text(yaml.safe_dump(run_config(base, run_dir, seed, {**RECIPES[name], **(extra or {})}, device)))
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.perf_counter()
    fit = [sys.executable, "-m", "dflash_lightning", "fit", "--config", str(config)]
    with open(run_dir / "fit.log", "w") as log:
        subprocess.run(fit, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    t1 = time.perf_counter()
    ckpt = str(run_dir / "checkpoints/last.ckpt")
    evaluate = [sys.executable, "-m", "dflash_lightning", "evaluate", "--drafter", ckpt, "--prompts", prompts,
                "--device", device, "--dtype", "float32", "--out", str(run_dir / "eval"),
                "--temperature", temperatures, "--seed", "0", *evaluate_args]
    with open(run_dir / "eval.log", "w") as log:
        subprocess.run(evaluate, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    t2 = time.perf_counter()
    report = json.loads(report_path.read_text())
    record = {
        "recipe": name, "seed": seed, "settings": {**RECIPES[name], **(extra or {})}, "config": config_name,
        "tau_pooled": report["tau_pooled"], "tau_prompt_mean": report["tau_prompt_mean"],
        "tokens_per_step": report["tokens_per_step"], "mismatches": report["mismatches"],
        "num_prompts": report["num_prompts"], "speedup": report["speedup"],
        "fit_s": round(t1 - t0, 1), "evaluate_s": round(t2 - t1, 1), "threads": threads, "device": device,
        "per_temperature": {t: {k: run.get(k) for k in ("tau_pooled", "tau_prompt_mean", "expected_tau_pooled",
                                                        "mismatches")}
                            for t, run in report.get("per_temperature", {}).items()},
        "selector": _last_selector_metrics(run_dir),
        "curve": _served_curve(run_dir),
    }
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


PART_METRICS = ("train/selector", "train/lilicorr", "train/dspark", "train/domino", "train/xpress")  # docs/parts.md


def _last_selector_metrics(run_dir: Path) -> dict:
    """The last logged values of the parts' metrics (DFlash2's selector, LiLiCorr's lattice, DSpark's heads, Domino's
    correction, XPress's refiner) and of train/tau, val/tau and val/loss in a run's CSV log."""
    import csv

    out: dict = {}
    for path in sorted(run_dir.glob("dflash/version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if value and (key.startswith(PART_METRICS) or key in ("train/tau", "val/tau", "val/loss")):
                        out[key] = float(value)
    return out


def _served_curve(run_dir: Path) -> dict[str, dict[str, float]]:
    """Served tau (`val/tau_served`, spec_eval's greedy decoding during the fit) and `val/tau` by step."""
    import csv

    out: dict[str, dict[str, float]] = {}
    for path in sorted(run_dir.glob("dflash/version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                for key in ("val/tau_served", "val/tau"):
                    if row.get(key):
                        out.setdefault(key, {})[row["step"]] = float(row[key])
    return out


def summary(records: list[dict], key: str) -> dict:
    values = [r[key] for r in records]
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tiny-objectives.json")
    parser.add_argument("--work", type=Path, default=ROOT / "runs/objective_ab", help="folder of the runs")
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma list of {', '.join(RECIPES)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each run; None: torch's default")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where fit and evaluate run")
    parser.add_argument("--temperatures", default="0", help="evaluate's --temperature list, e.g. 0,0.6,1")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting (dotted, YAML value) over every recipe's, e.g. data.feature_cache=DIR")
    parser.add_argument("--prompts", default=PROMPTS, help="evaluate's prompts")
    parser.add_argument("--num-prompts", type=int, default=None, help="evaluate only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="evaluate's --max_new_tokens")
    args = parser.parse_args()
    extra = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in args.set)}
    evaluate_args = tuple(
        a for flag, value in (("--num_prompts", args.num_prompts), ("--max_new_tokens", args.max_new_tokens))
        if value is not None for a in (flag, str(value)))
    base = yaml.safe_load((ROOT / args.config).read_text())
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"--recipes: unknown {unknown}; known: {list(RECIPES)}")
    plan = [(name, seed) for seed in seeds for name in names]  # seed-major: an interrupted A/B has every recipe
    records = []
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(one_run, name, seed, args.work.resolve(), base, args.config, args.threads, args.device,
                            args.temperatures, extra, args.prompts, evaluate_args) for name, seed in plan]
        for run in runs:
            records.append(run.result())
            print(json.dumps(records[-1]), flush=True)
            write_result(args, seeds, names, records)  # partial results survive an interruption


def write_result(args: argparse.Namespace, seeds: list[int], names: list[str], records: list[dict]) -> None:
    """The A/B JSON: per recipe the mean, spread and values of served tau (pooled, and the mean of per-prompt)."""
    recipes = {}
    for name in names:
        runs = [r for r in records if r["recipe"] == name]
        if runs:
            recipes[name] = {"settings": RECIPES[name], "seeds": [r["seed"] for r in runs],
                             **{key: summary(runs, key) for key in ("tau_pooled", "tau_prompt_mean", "fit_s")}}
            temps = runs[0].get("per_temperature") or {}
            recipes[name]["per_temperature"] = {
                t: {key: summary([{key: r["per_temperature"][t][key]} for r in runs], key)
                    for key in ("tau_pooled", "tau_prompt_mean", "expected_tau_pooled")
                    if all(r["per_temperature"].get(t, {}).get(key) is not None for r in runs)}
                for t in temps}
    result = {
        "date": time.strftime("%Y-%m-%d"), "config": args.config, "seeds": seeds, "prompts": args.prompts,
        "command": "python benchmarks/objective_ab.py " + " ".join(sys.argv[1:]),
        "recipes": recipes, "runs": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
