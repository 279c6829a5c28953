"""Figures the benchmarks build on, read from the results file that measured them: none is typed into code, so a rerun
that rewrites the file moves every figure derived from it (tests/test_measured_figures.py finds typed ones)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).with_name("results")
STEP_RESULT = RESULTS / "h200-2026-11-29.json"
"""benchmarks/step_bench.py on one H200: the compiled drafter step at 8192 tokens and 512 anchors."""
SCALING_RESULT = RESULTS / "h200x2-2026-11-29-scaling.jsonl"
"""benchmarks/scaling_bench.py on two H200s: one line per layout."""


def h200_drafter_step_s() -> float:
    """Seconds of the compiled drafter step (default compile mode) on one H200, at 8192 tokens and 512 anchors."""
    return json.loads(STEP_RESULT.read_text())["drafter_step"]["compiled[default]"]["step_s"]


def ddp_efficiency() -> float:
    """The scaling efficiency of DDP over two H200s with the target co-located: context tokens/s against twice one
    GPU's, measured in the same run."""
    rows = [json.loads(line) for line in SCALING_RESULT.read_text().splitlines() if line.strip()]
    (row,) = [r for r in rows if r["gpus"] == 2 and r["strategy"] == "ddp" and r["placement"] == "colocated"]
    return row["scaling_efficiency"]
