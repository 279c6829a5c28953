"""The notebooks run top to bottom on the CPU (their code cells, in order, in one namespace), as a user runs them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib
import pytest

ROOT = Path(__file__).parents[1]


def run_notebook(name: str, tmp_path: Path) -> dict:
    """Execute the code cells of notebooks/<name>; its run folders go under tmp_path."""
    notebook = json.loads((ROOT / "notebooks" / name).read_text())
    namespace: dict = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"]).replace('"runs/', f'"{tmp_path}/runs/')
            exec(compile(source, name, "exec"), namespace)
    return namespace


@pytest.fixture
def at_root(monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(ROOT)
    yield
    assert os.getcwd() == str(ROOT)


def test_explore_notebook_runs(at_root, monkeypatch, tmp_path):
    monkeypatch.setenv("EXPLORE_STEPS", "8")
    monkeypatch.setenv("DFLASH_FIGURES", str(tmp_path / "figures"))
    ns = run_notebook("explore.ipynb", tmp_path)
    assert ns["trainer"].global_step == 8
    assert ns["same"]  # speculative decoding equals the target alone
    assert len(ns["steps"]) == 2  # metrics at steps 0 and 4 (metrics_every=4)
    saved = {p.stem for p in (tmp_path / "figures").glob("*.png")}
    assert saved == {"batch", "masks", "loss", "slot_accuracy", "tau_estimate", "steps"}


def test_evaluate_notebook_makes_and_plots_a_report(at_root, monkeypatch, tmp_path):
    monkeypatch.setenv("EVALUATE_NB_STEPS", "8")
    monkeypatch.setenv("EVALUATE_NB_PROMPTS", "3")
    monkeypatch.setenv("DFLASH_FIGURES", str(tmp_path / "figures"))
    ns = run_notebook("evaluate.ipynb", tmp_path)
    report = ns["reports"]["tiny default"]
    assert report["num_prompts"] == 3 and report["mismatches"] == 0
    assert set(ns["series"]) == {"tiny default: val/tau", "tiny default: val/tau_served"}
    saved = {p.stem for p in (tmp_path / "figures").glob("*.png")}
    assert saved == {"acceptance_histogram", "slot_acceptance", "tau_per_category", "tau_per_temperature",
                     "train_vs_served"}
