"""A/B of training recipes on the tiny default: served tau by real speculative decoding, over seeds.

Each run is `fit --config configs/tiny.yaml` with the recipe's settings and `--seed_everything=N`,
then `evaluate` of its last.ckpt on the 74 held-out prompts, as the README's first command does (its counting:
`tau_pooled` over all steps and `tau_prompt_mean`, docs/method.md section 6):

    python benchmarks/objective_ab.py --out benchmarks/results/tiny-objectives.json

Runs go one at a time by default, seed by seed (`--jobs N --threads M` runs N at once with M threads each, on
a machine with N * M free cores); a finished run is read, not redone, so an interrupted A/B resumes. A run folder
keeps the arguments it was made with (`arguments.json`: the config and its content, the recipe's settings with --set
and --steps, the seed, --device, --temperatures, --prompts and evaluate's options); one made with others is refused.
The DFlash / DFlash2 A/B (issue 24), sampled too, on a GPU (`--device cuda`: fit and evaluate there, in fp32):

    python benchmarks/objective_ab.py --recipes dpace-ce,dflash2-dpace-ce --temperatures 0,0.6,1 --device cuda \
        --out benchmarks/results/tiny-dflash2-ab.json

DSpark against DFlash2 at the tiny default's block size (issue 37; as run on the CPU beside LiLiCorr, seed 0:
benchmarks/results/cpu-2026-12-04-tiny-lilicorr-dspark-seed0.json):

    python benchmarks/objective_ab.py --recipes dflash2-dpace-ce,dspark --temperatures 0,0.6,1 --device cuda \
        --out benchmarks/results/tiny-dspark-ab.json

LiLiCorr's candidate-token pathway (issue 43): walk minus argmax on the training lattice against steps, a 200-step
screen of lattice widths and token_proj init stds without serving (`--fit-only`; the curves land in the JSON), then
the chosen lattice served against DFlash2, a longer run and a warm start from the DFlash2 run of the same seed:

    python benchmarks/objective_ab.py --recipes lilicorr-conv-dpace-ce,lilicorr-conv-w256,lilicorr-conv-w256-std0.5 \
        --seeds 0 --steps 200 --fit-only --out X.json
    python benchmarks/objective_ab.py --recipes dflash2-dpace-ce,lilicorr-conv-tokens,lilicorr-conv-tokens-warm \
        --seeds 0,1 --temperatures 0,0.6,1 --out Y.json

XPress against DFlash2 and DSpark (issue 44; `xpress` ran on the CPU, seeds 0 and 1, with `domino`:
benchmarks/results/cpu-2026-12-05-tiny-xpress-domino.json; its two alternatives have not): `xpress` drafts as vLLM
0.34 serves it (the greedy Jacobi block, point masses at T > 0), `xpress-gumbel` with the xPress harness's sampled
drafts and their q at T > 0 (the same at T 0), `xpress-prev0-anchor` trains with the anchor as prev_0, which is what
vLLM feeds when it serves:

    python benchmarks/objective_ab.py --recipes dflash2-dpace-ce,dspark,xpress,xpress-gumbel,xpress-prev0-anchor \
        --temperatures 0,0.6,1 --seeds 0,1 --device cuda --out benchmarks/results/tiny-xpress-ab.json

Domino against DFlash2 and DSpark at the tiny default's block size (issue 44; `domino` ran on the CPU, as above):

    python benchmarks/objective_ab.py --recipes dflash2-dpace-ce,dspark,domino --temperatures 0,0.6,1 --device cuda \
        --out benchmarks/results/tiny-domino-ab.json

Features from an FP8 target against a bf16 one (issue 26), on a Hopper GPU:

    python benchmarks/objective_ab.py --recipes target-bf16,target-fp8 --device cuda --jobs 6 --threads 2 --out X.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# each recipe: config keys, dotted as on the command line, over configs/tiny.yaml
DPACE = {"model.objective": "ce", "model.loss_weights": "dpace"}
TINY_LATTICE = {"model.drafter.lilicorr.hidden_size": 0, "model.drafter.lilicorr.factor_dim": 128}
B7 = {"model.drafter.block_size": 7, "model.drafter.gamma": 4.0}
XPRESS = {"model.objective": "ce", "model.loss_weights": "decay", "model.drafter.variant": "xpress"}
LILICORR_CONV = {**DPACE, "model.drafter.variant": "lilicorr-conv"}


def lattice(width: int, token_proj_std: float | None = None) -> dict:
    """A tiny lattice of width Hh (not the drafter's 128, so it has a token_proj) and token_proj's init std."""
    std = {} if token_proj_std is None else {"model.drafter.lilicorr.token_proj_std": token_proj_std}
    return {**LILICORR_CONV, **TINY_LATTICE, "model.drafter.lilicorr.hidden_size": width, **std}


def target_shape(base: dict) -> tuple[int, float]:
    """H and the mean row norm of the input embedding of the config's target (a local folder)."""
    return _target_shape(base["target"]["path"])


@functools.cache
def _target_shape(target: str) -> tuple[int, float]:
    from safetensors import safe_open

    path = ROOT / Path(target).expanduser()  # relative to the repository, or absolute (~ expanded)
    if not (path / "config.json").exists():
        raise SystemExit(f"target.path {target}: the scaled lattice recipes read a local folder's config.json and "
                         "embedding")
    config = json.loads((path / "config.json").read_text())
    hidden = config.get("hidden_size") or config["text_config"]["hidden_size"]
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight"):
                    return hidden, float(f.get_tensor(key).float().norm(dim=1).mean())
    raise SystemExit(f"{path}: no embed_tokens.weight in its safetensors files")


def scaled_lattice(ratio: float) -> dict:
    """The tiny screen's choice carried to any target (values computed from the --config's target at run time):
    Hh = H/2, F = H, and token_proj's init std such that a candidate's token term starts at `ratio` times the
    pass-hidden term's scale, ratio * 0.02 sqrt(H) / mean |E row| (the tiny target: 64, 128, std 1.99 at 3.5)."""
    def std(base: dict) -> float:
        hidden, norm = target_shape(base)
        return round(ratio * 0.02 * hidden**0.5 / norm, 3)

    return {**LILICORR_CONV, "model.drafter.lilicorr.hidden_size": lambda base: target_shape(base)[0] // 2,
            "model.drafter.lilicorr.factor_dim": lambda base: target_shape(base)[0],
            "model.drafter.lilicorr.token_proj_std": std}


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
    # LiLiCorr's candidate-token pathway (issue 43): at hidden_size 0 a candidate enters only as its frozen embedding
    # row (norm ~0.40 on the tiny target); a lattice of another width has a token_proj whose init std sets that gain
    "lilicorr-conv-w64": lattice(64),
    "lilicorr-conv-w64-std0.5": lattice(64, 0.5),
    "lilicorr-conv-w64-std2": lattice(64, 2.0),
    "lilicorr-conv-w256": lattice(256),
    "lilicorr-conv-w256-std0.5": lattice(256, 0.5),
    "lilicorr-conv-w256-std2": lattice(256, 2.0),
}
# Domino with its GRU and projector at ModelOpt's proportions of the --config target's width (H/4 and H/16)
RECIPES["domino-scaled"] = {**RECIPES["domino"],
                            "model.drafter.domino.gru_hidden_dim": lambda b: target_shape(b)[0] // 4,
                            "model.drafter.domino.emb_dim": lambda b: target_shape(b)[0] // 16}
RECIPES["lilicorr-conv-tokens"] = RECIPES["lilicorr-conv-w64-std2"]  # the screen's choice (RESULTS.md, issue 43)
RECIPES["lilicorr-conv-tokens-scaled"] = scaled_lattice(3.5)  # the same for another target: --config X.yaml
RECIPES["lilicorr-conv-tokens-scaled-warm"] = {**RECIPES["lilicorr-conv-tokens-scaled"],
                                               "model.init_from": "@dflash2-dpace-ce"}
# warm start: "@recipe" is that recipe's last.ckpt of the same seed and steps, fit first if it is not there
RECIPES["lilicorr-conv-tokens-warm"] = {**RECIPES["lilicorr-conv-tokens"], "model.init_from": "@dflash2-dpace-ce"}
# Draft-OPD (issue 56, docs/opd.md): a DFlash drafter's 400 supervised steps ("@recipe/400": that recipe's run of 400
# steps), then --steps more of each arm from its weights, at the same halved lr (the paper's OPD lr is half its SFT's)
OPD_BASE = {**DPACE, "model.drafter.variant": "dflash"}
RECIPES["dflash-dpace-ce"] = OPD_BASE
RECIPES["sft-continued"] = {**OPD_BASE, "model.init_from": "@dflash-dpace-ce/400", "model.lr": 1.5e-3}
RECIPES["opd"] = {**RECIPES["sft-continued"], "model.stage": "opd"}
RECIPES["opd-approx"] = {**RECIPES["opd"], "model.opd.replay": False}
# the stage tuned toward continued supervision: a third of the lr, the rejected slots' term at a quarter of the
# accepted's, and the supervised loss kept beside the stage's (model.opd.sft_weight)
RECIPES["opd-lr5e-4"] = {**RECIPES["opd"], "model.lr": 5e-4}
RECIPES["opd-tuned"] = {**RECIPES["opd-lr5e-4"], "model.opd.lambda_rej": 0.25, "model.opd.sft_weight": 1.0}
RECIPES["opd-tuned-lr1.5e-3"] = {**RECIPES["opd-tuned"], "model.lr": 1.5e-3}
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


def run_name(name: str, seed: int, steps: int | None = None) -> str:
    """The run's folder under --work: recipe, steps where not the config's, seed."""
    return f"{name}{f'-steps{steps}' if steps else ''}-seed{seed}"


_RUN_LOCKS: dict[Path, threading.Lock] = {}
_RUN_LOCKS_GUARD = threading.Lock()


def _run_lock(run_dir: Path) -> threading.Lock:
    """One lock per run folder: a warm start's dependency fitted by one thread is waited for, not fitted again."""
    with _RUN_LOCKS_GUARD:
        return _RUN_LOCKS.setdefault(run_dir.resolve(), threading.Lock())


def one_run(name: str, seed: int, work: Path, base: dict, config_name: str, threads: int | None = None,
            device: str = "cpu", temperatures: str = "0", steps: int | None = None, fit_only: bool = False,
            extra: dict | None = None, prompts: str = PROMPTS, evaluate_args: tuple[str, ...] = ()) -> dict:
    """fit then evaluate one recipe and seed (or read the finished run); its figures. `steps` replaces the config's
    max_steps; `fit_only` skips evaluate (the part's curves are the figures); `extra`: settings (dotted keys) over
    every recipe's (a shared feature cache, say); `evaluate_args`: more `evaluate` options. Thread-safe: one thread
    at a time works in a run's folder."""
    with _run_lock(work / run_name(name, seed, steps)):
        return _one_run(name, seed, work, base, config_name, threads, device, temperatures, steps, fit_only, extra,
                        prompts, evaluate_args)


ARGUMENTS = "arguments.json"
"""A run folder's record of every argument that changes its fit or its evaluation, written before the fit starts."""


def check_arguments(run_dir: Path, arguments: dict) -> None:
    """Refuse a run folder made with other arguments (its run.json holds their figures) or whose arguments are not
    recorded, naming the ones that differ; a new folder gets them."""
    path = run_dir / ARGUMENTS
    arguments = json.loads(json.dumps(arguments))  # as read back: lists for tuples
    if path.exists():
        made = json.loads(path.read_text())
        differ = sorted(k for k in made.keys() | arguments.keys() if made.get(k) != arguments.get(k))
        if differ:
            raise SystemExit(f"{run_dir}: made with other {', '.join(differ)} than this run's; give another --work or "
                             "remove the folder")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise SystemExit(f"{run_dir}: a run folder without {ARGUMENTS}, so the arguments it was made with are not "
                         "known; give another --work or remove the folder")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(arguments, indent=2) + "\n")


def _one_run(name: str, seed: int, work: Path, base: dict, config_name: str, threads: int | None, device: str,
             temperatures: str, steps: int | None, fit_only: bool, extra: dict | None, prompts: str,
             evaluate_args: tuple[str, ...]) -> dict:
    """`one_run` inside its folder's lock."""
    run_dir = work / run_name(name, seed, steps)
    report_path = run_dir / "eval" / "report.json"
    record_path = run_dir / "run.json"
    settings = {k: v(base) if callable(v) else v for k, v in RECIPES[name].items()}  # from the config's target
    settings |= extra or {}
    if steps:
        settings["trainer.max_steps"] = steps
    # threads and fit_only change no figure (a fit-only run's fit is the full run's)
    check_arguments(run_dir, {"config": config_name, "config_content": base, "recipe": name, "settings": settings,
                              "seed": seed, "device": device, "temperatures": temperatures, "prompts": prompts,
                              "evaluate_args": evaluate_args})
    if record_path.exists() and (fit_only or report_path.exists()):
        return json.loads(record_path.read_text())
    for key, value in settings.items():  # "@recipe[/steps]": that recipe's last checkpoint of this seed (of these
        if isinstance(value, str) and value.startswith("@"):  # steps, else this run's), fit first if absent (fit
            source, _, of = value[1:].partition("/")  # only: name it in --recipes to evaluate it too)
            of = int(of) if of else steps
            one_run(source, seed, work, base, config_name, threads, device, temperatures, of, True, extra,
                    prompts, evaluate_args)
            settings[key] = str(work / run_name(source, seed, of) / "checkpoints/last.ckpt")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "config.yaml"
    config_dict = run_config(base, run_dir, seed, settings, device)
    config.write_text(yaml.safe_dump(config_dict))
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.perf_counter()
    fit = [sys.executable, "-m", "dflash_lightning", "fit", "--config", str(config)]  # resumes an interrupted fit
    with open(run_dir / "fit.log", "a") as log:
        subprocess.run(fit, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    t1 = time.perf_counter()
    record = {"recipe": name, "seed": seed, "settings": settings, "config": config_name,
              "fit_s": round(t1 - t0, 1), "threads": threads, "device": device, "steps": steps}
    if not fit_only:
        ckpt = run_dir / "checkpoints/last.ckpt"
        evaluate = [sys.executable, "-m", "dflash_lightning", "evaluate", "--drafter", str(ckpt), "--prompts",
                    prompts, "--device", device, "--dtype", "float32", "--out", str(run_dir / "eval"),
                    "--temperature", temperatures, "--seed", "0", *evaluate_args]
        with open(run_dir / "eval.log", "w") as log:
            subprocess.run(evaluate, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
        report = json.loads(report_path.read_text())
        record |= {
            "tau_pooled": report["tau_pooled"], "tau_prompt_mean": report["tau_prompt_mean"],
            "tokens_per_step": report["tokens_per_step"], "mismatches": report["mismatches"],
            "num_prompts": report["num_prompts"], "speedup": report["speedup"],
            "evaluate_s": round(time.perf_counter() - t1, 1),
            "per_temperature": {t: {k: run.get(k) for k in ("tau_pooled", "tau_prompt_mean", "expected_tau_pooled",
                                                            "mismatches")}
                                for t, run in report.get("per_temperature", {}).items()},
        }
    record["selector"] = _last_selector_metrics(run_dir)
    record["curves"] = part_curves(run_dir)  # served tau (val/tau_served) against steps among them
    if "train/lilicorr/supervised" in record["curves"]:  # the lattice's training signal so far (issue 43)
        model = config_dict["model"]
        record["curves"]["train/lilicorr/supervised_slots"] = supervised_slots(
            record["curves"]["train/lilicorr/supervised"], model["num_anchors"], model["drafter"]["block_size"] - 1)
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


CURVE_KEYS = ("train/tau", "val/tau", "val/tau_served", "train/selector/tau", "val/selector/tau",
              *(f"{stage}/lilicorr/{m}" for stage in ("train", "val")
                for m in ("tau", "argmax_tau", "oracle_tau", "recall", "supervised")))


def part_curves(run_dir: Path) -> dict[str, list]:
    """Every logged value of CURVE_KEYS against the step, from the run's CSV log: {key: [[step, value], ...]}, and
    where LiLiCorr logs, `<stage>/lilicorr/walk_minus_argmax` (the walk's prefix minus the argmax's, one batch each
    train row, the validation batches each val row)."""
    import csv

    out: dict[str, list] = {}
    for path in sorted(run_dir.glob("dflash/version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                for key in CURVE_KEYS:
                    if row.get(key):
                        out.setdefault(key, []).append([int(row["step"]), float(row[key])])
    for stage in ("train", "val"):
        walk, argmax = (dict(map(tuple, out.get(f"{stage}/lilicorr/{m}", []))) for m in ("tau", "argmax_tau"))
        if walk:
            out[f"{stage}/lilicorr/walk_minus_argmax"] = [[k, walk[k] - argmax[k]] for k in walk if k in argmax]
    return out


def supervised_slots(curve: list, anchors: int, slots: int) -> list:
    """The lattice's supervised slots so far against the step, from a `train/lilicorr/supervised` curve (the
    fraction of the A x S slots one logged batch supervised): each point stands for the steps since the previous
    one, at `anchors` x `slots` slots a step. [[step, cumulative count], ...]"""
    out, total, previous = [], 0.0, -1
    for step, fraction in curve:
        total += fraction * (step - previous) * anchors * slots
        out.append([step, round(total)])
        previous = step
    return out


def binned(curve: list, width: int) -> list:
    """Means of a [[step, value], ...] curve over consecutive step windows of `width`: [[last step, mean], ...]."""
    bins: dict[int, list[float]] = {}
    for step, value in curve:
        bins.setdefault(step // width, []).append(value)
    return [[(b + 1) * width, round(statistics.fmean(v), 4)] for b, v in sorted(bins.items())]


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
    parser.add_argument("--steps", type=int, default=None, help="trainer.max_steps of every run; None: the config's")
    parser.add_argument("--fit-only", action="store_true", help="no evaluate: the parts' curves are the figures")
    parser.add_argument("--bin", type=int, default=40, help="steps per bin of the JSON's binned training curves")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting (dotted, YAML value) over every recipe's, e.g. data.feature_cache=DIR")
    parser.add_argument("--prompts", default=PROMPTS, help="evaluate's prompts")
    parser.add_argument("--num-prompts", type=int, default=None, help="evaluate only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="evaluate's --max_new_tokens")
    parser.add_argument("--baseline", default=None, choices=["all", "greedy"],
                        help="evaluate's --baseline: greedy times the target alone at T 0 only")
    args = parser.parse_args()
    extra = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in args.set)}
    evaluate_args = tuple(
        a for flag, value in (("--num_prompts", args.num_prompts), ("--max_new_tokens", args.max_new_tokens),
                              ("--baseline", args.baseline))
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
                            args.temperatures, args.steps, args.fit_only, extra, args.prompts, evaluate_args)
                for name, seed in plan]
        for run in as_completed(runs):  # a run's record is written as soon as it ends, whatever the plan's order
            records.append(run.result())
            print(json.dumps(records[-1]), flush=True)
            write_result(args, seeds, names, records)  # partial results survive an interruption


def write_result(args: argparse.Namespace, seeds: list[int], names: list[str], records: list[dict]) -> None:
    """The A/B JSON: per recipe the mean, spread and values of served tau (pooled, and the mean of per-prompt)."""
    recipes = {}
    for name in names:
        runs = [r for r in records if r["recipe"] == name]
        if runs:
            recipes[name] = {"settings": runs[0]["settings"], "seeds": [r["seed"] for r in runs],
                             **{key: summary(runs, key) for key in ("tau_pooled", "tau_prompt_mean", "fit_s")
                                if all(key in r for r in runs)}}
            curves = {key: {r["seed"]: binned(r["curves"][key], args.bin) if key.startswith("train/") else
                            r["curves"][key] for r in runs}
                      for key in ("val/tau_served", "train/lilicorr/walk_minus_argmax",
                                  "val/lilicorr/walk_minus_argmax", "val/lilicorr/tau", "val/lilicorr/argmax_tau",
                                  "val/lilicorr/oracle_tau")
                      if all(key in r.get("curves", {}) for r in runs)}
            if curves:  # served tau and the walk's lead over the unary argmax against steps, per seed
                recipes[name]["curves"] = curves
            temps = runs[0].get("per_temperature") or {}
            recipes[name]["per_temperature"] = {
                t: {key: summary([{key: r["per_temperature"][t][key]} for r in runs], key)
                    for key in ("tau_pooled", "tau_prompt_mean", "expected_tau_pooled")
                    if all(r["per_temperature"].get(t, {}).get(key) is not None for r in runs)}
                for t in temps}
    result = {
        "date": time.strftime("%Y-%m-%d"), "config": args.config, "seeds": seeds, "steps": args.steps,
        "curve_bin_steps": args.bin, "prompts": args.prompts,
        "command": "python benchmarks/objective_ab.py " + " ".join(sys.argv[1:]),
        "recipes": recipes, "runs": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
