"""The tiny default's per-step training losses against a stored curve (torchtitan's habit).

A change that silently alters training (masks, anchors, slot weights, the loss, the optimizer, the data order)
moves this curve and fails here, even where every unit test of a rule still passes. The run is
configs/tiny.yaml itself, cut to 30 steps on one CPU thread in fp32 with seed 0: no validation, served tau,
images or checkpoints, so only training numerics are compared.

A change MEANT to alter training rewrites the stored curve on purpose, and says why in its commit:

    python tests/test_loss_curve.py --write      # from the repository root; rewrites tests/data/tiny_loss_curve.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
STORED = Path(__file__).resolve().parent / "data" / "tiny_loss_curve.json"
STEPS = 30
# fp32 on one thread repeats bitwise on one machine; other CPUs (AVX2 against AVX-512 kernels) and torch
# releases reorder sums, which moves a loss by about 1e-6 relative per step. A real change to training moves
# the early curve by far more than this (a changed anchor, weight or mask rule: percents).
RTOL = 1e-3


def tiny_config(root: Path) -> dict:
    """configs/tiny.yaml for STEPS training steps, every step's loss logged to a CSV file under `root`."""
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config["target"]["path"] = str(REPO / config["target"]["path"])
    for key in ("train_files", "val_files"):
        config["data"][key] = [str(REPO / f) for f in config["data"][key]]
    config["model"]["metrics_every"] = 1
    config["trainer"].update(
        max_steps=STEPS, log_every_n_steps=1, limit_val_batches=0, val_check_interval=None, default_root_dir=str(root),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[],
        logger=[{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root)}}],
    )
    config["spec_eval"] = {"prompts": None, "every_n_steps": 0}
    config["images"] = {"enabled": False}
    return config


def run_curve() -> dict:
    """Fit the cut-down tiny default in a temporary folder: its settings and per-step `train/loss`."""
    from dflash_lightning.commands.cli import cli_main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            path = root / "config.yaml"
            path.write_text(yaml.safe_dump(tiny_config(root)))
            cli_main(["fit", "--config", str(path)])
            rows = list(csv.DictReader(next(root.rglob("metrics.csv")).open()))
    finally:
        torch.set_num_threads(threads)
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    return {
        "what": f"configs/tiny.yaml, first {STEPS} steps, CPU, fp32, seed 0, one thread: train/loss per step",
        "regenerate": "python tests/test_loss_curve.py --write",
        "torch": torch.__version__,
        "steps": sorted(losses),
        "loss": [losses[s] for s in sorted(losses)],
    }


def test_the_tiny_default_trains_along_the_stored_curve():
    stored = json.loads(STORED.read_text())
    now = run_curve()
    assert now["steps"] == stored["steps"] == list(range(STEPS)), now["steps"]
    assert all(math.isfinite(x) for x in now["loss"])
    off = [(s, a, b) for s, a, b in zip(now["steps"], now["loss"], stored["loss"], strict=True)
           if not math.isclose(a, b, rel_tol=RTOL)]
    assert not off, (
        f"the tiny run's losses left the stored curve at {len(off)} of {STEPS} steps (step, now, stored): "
        f"{off[:5]}; if training was meant to change, rewrite it with `{stored['regenerate']}`"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"rewrite {STORED.relative_to(REPO)}")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))  # this checkout's package, as `python -m pytest` from the root imports it
    curve = run_curve()
    text = json.dumps(curve, indent=1) + "\n"
    if args.write:
        STORED.write_text(text)
        print(f"wrote {STORED} ({len(curve['loss'])} steps)")
    else:
        print(text)
