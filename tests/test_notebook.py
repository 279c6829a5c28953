"""The quickstart notebook runs top to bottom (its code cells, in order, in one namespace)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

ROOT = Path(__file__).parents[1]


def test_quickstart_notebook_runs(monkeypatch, tmp_path):
    matplotlib.use("Agg")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("QUICKSTART_STEPS", "3")
    notebook = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
    namespace: dict = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"]).replace("runs/notebook", str(tmp_path / "runs"))
            exec(compile(source, "quickstart.ipynb", "exec"), namespace)
    assert namespace["trainer"].global_step == 3
    assert namespace["report"]["mismatches"] == 0
    assert os.getcwd() == str(ROOT)
