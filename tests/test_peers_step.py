"""benchmarks/peers_step.py's own code, without the peers: its clock, the pairs it refuses, the table it collects.

The peers' CPU smoke (their packages and their steps at `--shape tiny`) is `bash benchmarks/peers_gpu.sh OUT smoke`,
run by hand: the peers are no project dependency (speculators 0.9 pins torch <= 2.14.1, below CI's newest set) and
their steps take minutes on 2 cores (docs/peers.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))
pytestmark = pytest.mark.pinned_only("tool")  # the benchmarks are ours to run, on the pinned set

from benchmarks import peers_step  # noqa: E402


def test_clock_times_the_steps_after_the_warmup_and_refuses_a_loop_that_stopped_early():
    clock = peers_step.StepClock(warmup=2, steps=3, device=torch.device("cpu"))
    clock.start()
    for _ in range(5):
        clock()
    timed = clock.result()
    assert timed["step_s"] >= 0 and timed["warmup_s"] >= timed["first_step_s"] >= 0
    short = peers_step.StepClock(warmup=2, steps=3, device=torch.device("cpu"))
    short.start()
    for _ in range(4):  # the peer's loop ended one step short: no figure, an error naming the count
        short()
    with pytest.raises(RuntimeError, match="4 of 5"):
        short.result()


def test_a_pair_no_peer_trains_is_written_with_its_reason(tmp_path, monkeypatch, capsys):
    out = tmp_path / "speculators-domino.json"
    monkeypatch.setattr(sys, "argv", ["peers_step.py", "--peer", "speculators", "--variant", "domino", "--device",
                                      "cpu", "--out", str(out)])
    peers_step.main()
    row = json.loads(out.read_text())
    assert row["cannot_run"].startswith("speculators 0.9.0 has no Domino") and "step_s" not in row
    assert all(pair not in peers_step.RUNS for pair in peers_step.CANNOT)  # a pair is run or refused, not both


def test_collect_pairs_each_peer_with_ours_and_names_what_failed_or_cannot_run(tmp_path):
    ours = {"gpu": "card", "drafter_step": {peers_step.OURS_RUN: {"step_s": 0.2, "peak_gb": 30.0}}}
    (tmp_path / "ours-dspark.json").write_text(json.dumps(ours))
    (tmp_path / "speculators-dspark.json").write_text(json.dumps({"step_s": 0.3, "peak_gb": 40.0, "device": "card"}))
    (tmp_path / "specforge-dspark.log").write_text("Traceback ...\nRuntimeError: boom\n")
    (tmp_path / "modelopt-dspark.json").write_text(json.dumps({"cannot_run": "why", "device": "card"}))
    rows = {row["peer"]: row for row in peers_step.collect(tmp_path)}
    assert rows["speculators"]["ratio"] == pytest.approx(1.5) and rows["speculators"]["ours_card"] == "card"
    assert rows["specforge"]["failed"] == "RuntimeError: boom" and "ratio" not in rows["specforge"]
    assert rows["modelopt"]["cannot_run"] == "why" and "ratio" not in rows["modelopt"]
