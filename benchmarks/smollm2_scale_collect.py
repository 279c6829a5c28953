"""The figures of a `benchmarks/smollm2_scale_gpu.sh` run, from its WORK folder (or the scale.tgz `wait` packed), as one
JSON: the answers' tokens per second, each run's fit time and tau against training tokens, the served reports on the
held-out prompts and HumanEval, the OPD stage's curves, the batch-1 tokens per second and the parity checks.

    python benchmarks/smollm2_scale_collect.py scale.tgz --card "NVIDIA H100" --out benchmarks/results/X.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from objective_ab import part_curves  # noqa: E402

REPORT_KEYS = ("num_prompts", "tau_pooled", "tau_prompt_mean", "expected_tau_pooled", "mismatches", "speedup")
ANSWERS = re.compile(r"regenerated source records (?P<first>[\d,]+)\.\.(?P<last>[\d,]+) into (?P<out>\S+) in "
                     r"(?P<seconds>[\d,.]+) s: (?P<written>[\d,]+) written, (?P<rejected>[\d,]+) rejected.*?"
                     r"(?P<turns>[\d,]+) turns \((?P<cut>[\d,]+) cut at max_new_tokens\), (?P<tokens>[\d,]+) tokens "
                     r"generated")


def number(text: str) -> float:
    return float(text.replace(",", ""))


def answers(work: Path) -> dict[str, Any]:
    """Each regenerate run's closing line, parsed: records, turns, tokens, seconds and tokens per second."""
    out = {}
    for log in sorted(work.glob("answers-*.log")):
        lines = [m for m in map(ANSWERS.search, log.read_text(errors="replace").splitlines()) if m]
        if lines:
            m = lines[-1]
            figures = {k: number(v) for k, v in m.groupdict().items() if k != "out"}
            figures["tokens_per_s"] = round(figures["tokens"] / figures["seconds"], 1)
            out[log.stem.removeprefix("answers-")] = figures
    return out


def reports(folder: Path) -> dict[str, Any]:
    """Per temperature, the served figures of an evaluate report.json."""
    path = folder / "report.json"
    if not path.exists():
        return {}
    report = json.loads(path.read_text())
    return {t: {k: r.get(k) for k in REPORT_KEYS} for t, r in report.get("per_temperature", {}).items()} | {
        "complete": report.get("complete")}


def run(folder: Path, token_budget: int) -> dict[str, Any]:
    """One fit's command, time, curves (with training tokens) and served reports."""
    logs = next(iter(sorted(folder.glob("runs/*"))), folder)
    curves = part_curves(logs)
    # Lightning's CSV rows repeat an epoch-level value until the next one: each evaluation once, at its first row
    served = [(s, v) for i, (s, v) in enumerate(curves.get("val/tau_served", []))
              if i == 0 or v != curves["val/tau_served"][i - 1][1]]
    time = json.loads((folder / "fit-time.json").read_text()) if (folder / "fit-time.json").exists() else {}
    steps = max((s for c in curves.values() for s, _ in c), default=0)
    return {
        "command": (folder / "command.txt").read_text().strip() if (folder / "command.txt").exists() else None,
        "fit": time | {"last_logged_step": steps},
        "tau_served_against_tokens": [[s, s * token_budget, v] for s, v in served],
        "curves": {k: v for k, v in curves.items() if k.startswith(("val/", "train/opd/"))},
        "heldout": reports(folder / "eval-heldout"),
        "humaneval": reports(folder / "eval-humaneval"),
    }


def collect(work: Path, card: str, token_budget: int) -> dict[str, Any]:
    speed = work / "decode-speed.json"
    return {
        "card": card,
        "answers": answers(work),
        "runs": {d.name: run(d, token_budget) for d in sorted(work.iterdir()) if (d / "command.txt").exists()},
        "decode_speed": json.loads(speed.read_text()) if speed.exists() else None,
        # benchmarks/train_serve_parity.py's results (benchmarks/opd_smollm2_gpu.sh)
        "parity": {f.stem.removeprefix("parity-"): json.loads(f.read_text())
                   for f in sorted(work.glob("parity-*.json"))},
        "progress": (work / "progress.log").read_text().splitlines() if (work / "progress.log").exists() else [],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", help="the WORK folder, or the scale.tgz of the script's `wait` part")
    parser.add_argument("--card", required=True, help="the GPU the run used, as nvidia-smi names it")
    parser.add_argument("--token-budget", type=int, default=8192, help="tokens per training step (data.token_budget)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    work = Path(args.work)
    with tempfile.TemporaryDirectory() as tmp:
        if work.is_file():
            with tarfile.open(work) as tar:
                tar.extractall(tmp, filter="data")
            work = Path(tmp)
        result = collect(work, args.card, args.token_budget)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("answers", "decode_speed")}, indent=2))


if __name__ == "__main__":
    main()
