"""The multi-GPU scaling benchmark's own code path, on the CPU with the tiny target (a smoke run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.pinned_only("tool")  # the benchmarks are ours to run, on the pinned set


def test_scaling_bench_cpu_smoke_writes_one_json_line(tmp_path):
    out = tmp_path / "scaling.jsonl"
    cmd = [sys.executable, "benchmarks/scaling_bench.py", "--cpu-smoke", "--placement", "separate",
           "--target-devices", "cpu", "--warmup", "1", "--steps", "2", "--baseline", "1000", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["placement"] == "separate" and row["gpus"] == 2 and row["steps"] == 3
    assert row["context_tokens_per_s"] > 0 and row["scaling_efficiency"] > 0


def test_step_bench_counts_the_pairs_each_layers_mask_shows():
    """The benchmark's attention FLOPs follow each layer's rule: pairs equal the dense masks' true entries."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_bench import drafter_shape, random_batch, visible_pairs

    from dflash_lightning.blocks import build_block_mask, select_anchors

    cfg = drafter_shape(sliding_layers=3, sliding_window=40)
    batch = random_batch(600, 8, seed=0, doc_tokens=(60, 300))
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 24, torch.Generator().manual_seed(0))
    dense = sum(int(build_block_mask(batch["doc_ids"], anchors, valid, 16, *cfg.attention_rule(i)).sum())
                for i in range(cfg.num_layers))
    assert visible_pairs(cfg, batch, 24) == dense
    assert visible_pairs(drafter_shape(), batch, 24) > dense  # the window hides pairs


def test_objective_ab_run_config_moves_every_output_and_sets_the_recipe(tmp_path):
    import yaml

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from objective_ab import RECIPES, run_config
    finally:
        sys.path.pop(0)
    base = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    cfg = run_config(base, tmp_path / "run", 2, RECIPES["dpace-kl"])
    assert cfg["seed_everything"] == 2 and cfg["model"]["objective"] == "kl" and cfg["model"]["loss_weights"] == "dpace"
    text = yaml.safe_dump(cfg)
    assert "runs/tiny" not in text and text.count(str(tmp_path / "run")) == 4  # root, 2 loggers, checkpoints
    assert base["model"]["objective"] == "ce"  # the base config is left as it was
    cfg = run_config(base, tmp_path / "run", 0, RECIPES["target-fp8"])
    assert cfg["target"]["fp8"] is True and cfg["target"]["dtype"] == "bfloat16"
    assert cfg["target"]["path"] == base["target"]["path"] and "fp8" not in base["target"]
    cfg = run_config(base, tmp_path / "run", 0, RECIPES["dflash2-dpace-ce"])
    assert cfg["model"]["drafter"] == {**base["model"]["drafter"], "variant": "dflash2"}
    cfg = run_config(base, tmp_path / "run", 0, RECIPES["xpress-prev0-anchor"])  # a part's setting, nested
    assert cfg["model"]["drafter"]["xpress"] == {"prev0": "anchor"} and cfg["model"]["loss_weights"] == "decay"
    cfg = run_config(base, tmp_path / "run", 0, RECIPES["domino"])  # the ranking's recipe makes a valid module
    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.module import DFlashModule
    from dflash_lightning.parts.domino import DominoSettings

    model = dict(cfg["model"])
    drafter = model.pop("drafter")
    assert drafter["variant"] == "domino" and drafter["domino"] == {"gru_hidden_dim": 32, "emb_dim": 8}
    DFlashModule(str(ROOT / cfg["target"]["path"]), DrafterConfig(**{**drafter, "domino": DominoSettings(
        **drafter["domino"])}), **model)


def test_objective_ab_fits_a_warm_starts_dependency_once_when_both_run_at_once(tmp_path, monkeypatch):
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import yaml

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import objective_ab
    finally:
        sys.path.pop(0)
    fits, started = [], threading.Barrier(2)

    def fake_run(cmd, **kwargs):  # a fit: its config's folder gets a checkpoint, slowly
        run_dir = Path(cmd[cmd.index("--config") + 1]).parent
        fits.append(run_dir.name)
        time.sleep(0.3)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints/last.ckpt").write_bytes(b"")
        if "lilicorr" in run_dir.name:  # its log: half of the 96 x 15 slots supervised at steps 0-7
            (run_dir / "dflash/version_0").mkdir(parents=True)
            (run_dir / "dflash/version_0/metrics.csv").write_text("step,train/lilicorr/supervised\n7,0.5\n")

    monkeypatch.setattr(objective_ab.subprocess, "run", fake_run)
    base = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())

    def run(name):
        started.wait()
        return objective_ab.one_run(name, 0, tmp_path, base, "configs/tiny.yaml", fit_only=True)

    with ThreadPoolExecutor(2) as pool:  # the warm start fits its dependency while the plan's own run of it waits
        warm, dependency = pool.map(run, ["lilicorr-conv-tokens-warm", "dflash2-dpace-ce"])
    assert sorted(fits) == ["dflash2-dpace-ce-seed0", "lilicorr-conv-tokens-warm-seed0"]
    assert warm["settings"]["model.init_from"] == str(tmp_path / "dflash2-dpace-ce-seed0/checkpoints/last.ckpt")
    assert dependency["recipe"] == "dflash2-dpace-ce"
    assert warm["curves"]["train/lilicorr/supervised_slots"] == [[7, 5760]]  # the run's own anchors and block
    assert "train/lilicorr/supervised_slots" not in dependency["curves"]


def test_objective_ab_reads_a_finished_run_only_with_the_arguments_it_was_made_with(tmp_path, monkeypatch):
    """A finished run is read back, not redone, for the same arguments; another --config content, --device,
    --temperatures, --set, --steps' setting, --prompts or evaluate option is refused by name, as is a folder that
    does not record its arguments."""
    import yaml

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import objective_ab
    finally:
        sys.path.pop(0)
    fits = []

    def fake_run(cmd, **kwargs):  # fit writes a checkpoint, evaluate a report
        if "fit" in cmd:
            fits.append(cmd)
            return
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "report.json").write_text(json.dumps({k: 1.0 for k in (
            "tau_pooled", "tau_prompt_mean", "tokens_per_step", "mismatches", "num_prompts", "speedup")}))

    monkeypatch.setattr(objective_ab.subprocess, "run", fake_run)
    base = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    kw = dict(temperatures="0", extra={}, prompts="p.jsonl", evaluate_args=("--num_prompts", "4"))

    def run(**change):
        args = {"base": base, "device": "cpu", **kw, **change}
        return objective_ab.one_run("dpace-ce", 0, tmp_path, args.pop("base"), "configs/tiny.yaml", **args)

    first = run()
    assert run() == first and len(fits) == 1  # read back
    other = {**base, "model": {**base["model"], "lr": 1e-3}}
    for change, named in [({"base": other}, "config_content"), ({"device": "cuda"}, "device"),
                          ({"temperatures": "0,1"}, "temperatures"), ({"extra": {"data.x": 1}}, "settings"),
                          ({"prompts": "q.jsonl"}, "prompts"), ({"evaluate_args": ()}, "evaluate_args")]:
        with pytest.raises(SystemExit, match=f"dpace-ce-seed0: made with other {named} than this run's"):
            run(**change)
    assert len(fits) == 1
    (tmp_path / "dpace-ce-seed0" / objective_ab.ARGUMENTS).unlink()  # as a folder made before they were recorded
    with pytest.raises(SystemExit, match="dpace-ce-seed0: a run folder without arguments.json"):
        run()


def test_step_bench_diagnostics_report_steps_settings_and_where_a_stage_stalled():
    """What makes a stalled GPU run readable: a line per step, the compiler settings, a timeout with its stack."""
    import time

    import pytest
    import torch._inductor.config as inductor

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_bench import StageTimeout, StepLog, compiler_settings, stage_timeout_in, within

    rows = []
    log = StepLog("pipe", rows.append)
    for step in range(3):
        log.on_train_batch_start(None, None, None, step)
        log.on_train_batch_end(None, None, None, None, step)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["run"] == "pipe" and r["host_s"] >= 0 for r in rows)
    assert all(isinstance(r["compiled_frames"], int) and isinstance(r["recompiles"], int) for r in rows)

    with inductor.patch(coordinate_descent_tuning=True):
        assert compiler_settings()["coordinate_descent_tuning"] is True

    def autotuning_forever():
        end = time.monotonic() + 10  # bounded, so a broken timeout fails the test instead of hanging it
        while time.monotonic() < end:
            time.sleep(0.01)

    start = time.monotonic()
    with pytest.raises(StageTimeout, match="(?s)not done after 1 s.*autotuning_forever") as caught:
        within(1, autotuning_forever)
    assert time.monotonic() - start < 5
    try:  # as torch's compiler re-raises an error from inside it
        raise RuntimeError("backend compiler failed") from caught.value
    except RuntimeError as wrapped:
        assert stage_timeout_in(wrapped) is caught.value and stage_timeout_in(RuntimeError()) is None
    assert within(1, lambda x: x + 1, 1) == 2 and within(0, lambda: "no limit") == "no limit"


def test_checkpoint_bench_cpu_smoke_measures_sync_and_background_saves(tmp_path):
    """The lead's H200 command, at 24 MB on the CPU: both kinds of save measured, each background file checked."""
    out = tmp_path / "checkpoint.json"
    cmd = [sys.executable, "benchmarks/checkpoint_bench.py", "--device", "cpu", "--size-gb", "0.024", "--saves", "2",
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert abs(result["size_bytes"] - 24e6) < 1e5 and result["sync"]["stall_s"] > 0
    assert len(result["async"]) == 2 and all(s["write_s"] > 0 and s["stall_s"] >= 0 for s in result["async"])
    assert result["async_write_GBps"] > 0 and not [p for p in tmp_path.iterdir() if p != out]  # files removed


def test_checkpoint_bench_ranks_measures_the_distributed_save_against_the_single_file(tmp_path):
    """--ranks 2 at 12 MB: both saves timed, each rank's share of the folder counted, both loaded; files removed."""
    out = tmp_path / "ranks.json"
    cmd = [sys.executable, "benchmarks/checkpoint_bench.py", "--device", "cpu", "--size-gb", "0.012", "--saves", "1",
           "--ranks", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    shares = result["distributed"]["rank_bytes"]
    assert len(shares) == 2 and all(s > 0 for s in shares) and sum(shares) <= result["distributed"]["bytes"]
    assert result["single_file"]["save_s"][0] > 0 and result["distributed"]["load_s"] > 0
    assert not [p for p in tmp_path.iterdir() if p != out]


def test_projection_from_a_fit_counts_fill_length_and_checkpoint_stalls():
    """Hours = tokens / (rate * fill * gpus * efficiency), plus one stall per save interval, from a fit's JSON."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.project import project

    fit = {"step_s": 0.2, "context_tokens_per_s": 15000.0, "save_every_n_train_steps": 2000,
           "packing": {"padding_fraction": 0.1, "tokens": 9000, "documents": 10}}
    plain = project({**fit, "save_every_n_train_steps": None}, 8, 0.9, 800e3, 6, save_stall_s=48.0)
    expected = 800e3 * 6 * 900 / (15000 * 0.9 * 8 * 0.9) / 3600
    assert plain["hours"] == plain["training_hours"] == expected and plain["checkpoint_hours"] == 0
    stalled = project(fit, 8, 0.9, 800e3, 6, save_stall_s=48.0)
    assert stalled["checkpoint_hours"] == expected * 48.0 / (2000 * 0.2)  # 12% of the run at 48 s per save
    assert stalled["hours"] == expected + stalled["checkpoint_hours"]


def test_unused_compute_counts_padding_invalid_anchors_and_unweighted_slots():
    """The accounting of unused work runs on real packed batches and its fractions are consistent."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.unused_compute import count

    result = count(budget=512, anchors=64, block=8, docs=120, steps=3)
    per = result["per_step"]
    assert result["steps"] == 3 and per["slots"] == 64 * 8 and per["slot0"] == 64
    assert 0 <= result["padding_fraction"] < 1 and 0 <= result["unweighted_slot_fraction_of_slots_1_on"] <= 1
    assert per["slots_unweighted"] >= per["anchors_invalid"] * 7  # an invalid anchor's 7 slots all weigh 0


def test_fp8_curves_cpu_smoke_learns_from_the_mapped_tiny_target_and_rebuilds_from_its_logs(tmp_path):
    """fp8_curves.py end to end at a small shape: samples conversations from the tiny target, maps its features up,
    trains a curve of 10 steps (`@10`) and one of `--steps` 6, and rebuilds the same summary from the curves' logs."""
    work, out = tmp_path / "work", tmp_path / "curves.json"
    cmd = [sys.executable, "benchmarks/fp8_curves.py", "--arms", "bf16-mixed,bf16-mixed@10", "--seeds", "0",
           "--steps", "6", "--per-prompt", "1", "--max-new", "8", "--hidden", "256", "--drafter-layers", "1",
           "--vocab", "8192", "--token-budget", "512", "--anchors", "16", "--max-documents", "32", "--parallel", "1",
           "--tail", "4", "--work", str(work), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r.get("error") for r in report["runs"]] == [None, None], report["runs"]
    assert sorted(len(r["loss"]) for r in report["runs"]) == [6, 10]
    assert all(r["held_out"]["val/loss"] > 0 for r in report["runs"])
    assert list(report["summary"]) == ["10", "6"]  # one summary per curve length, the longest first
    assert set(report["summary"]["10"]["arms"]) == {"bf16-mixed"}
    assert report["data"]["unigram_entropy"] < report["data"]["uniform_entropy"]
    curves = next(r["loss"] for r in report["runs"] if r["steps"] == 10)
    assert sum(curves[-4:]) < sum(curves[:4])  # the mapped features are learnable: the loss falls
    rebuilt = tmp_path / "rebuilt.json"
    done = subprocess.run([*cmd[:2], "--from-logs", str(work), "--tail", "4", "--out", str(rebuilt)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(rebuilt.read_text())["summary"] == report["summary"]


def test_fit_bench_save_windows_put_each_save_in_the_step_after_it():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from fit_bench import save_windows
    finally:
        sys.path.pop(0)
    import pytest

    seconds = [1.0] * 10 + [3.0] + [1.5] * 4 + [1.0] * 15 + [2.0] + [1.0] * 3  # steps 21..54
    windows = save_windows(seconds, 21, 15, 9)  # saves at 30 and 45
    assert windows["no_save"]["mean_step_s"] == 1.0
    assert [(w["save_step"], w["steps"], w["excess_s"]) for w in windows["with_save"]] == [(30, 15, 4.0), (45, 9, 1.0)]
    windows = save_windows(seconds, 21, 30, 9)
    assert [(w["save_step"], w["steps"], w["excess_s"]) for w in windows["with_save"]] == [(30, 24, 5.0)]
    with pytest.raises(ValueError, match="hold a save"):
        save_windows(seconds, 21, 30, 11)  # steps 21..31: step 31 holds the save of step 30


def test_fit_bench_cpu_smoke_times_saves_and_a_preemption_through_the_user_fit(tmp_path):
    """The GPU config's own fit (background saves, link to last) on the tiny target: a save, then SIGTERM."""
    out = tmp_path / "fit.json"
    assets = ROOT / "dflash_lightning/assets/tiny"
    cmd = [sys.executable, "benchmarks/fit_bench.py", "--config", "configs/qwen3-8b.yaml", "--work", str(tmp_path),
           "--target", str(assets / "target_model"), "--data", str(assets / "data/train.jsonl"), "--warmup", "2",
           "--steps", "3", "--after", "6", "--save-every", "6", "--sigterm-at", "9", "--clean", "--out", str(out), "--",
           "--trainer.accelerator=cpu", "--trainer.precision=32-true", "--model.fp8=none", "--target.fp8=false",
           "--target.compile=false", "--model.compile=false", "--target.dtype=float32", "--data.token_budget=512",
           "--data.max_length=512", "--model.num_anchors=32"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exit_code"] == 143 and result["sigterm_at_step"] == 9, result.get("log_tail")
    assert 0 < result["signal_to_saved_s"] <= result["signal_to_exit_s"]
    assert result["step_s_each"]["first_step"] == 3 and len(result["step_s_each"]["seconds"]) == 7  # steps 3..9
    (window,) = result["save_windows"]["with_save"]
    assert window["save_step"] == 6 and window["steps"] == 3
    sizes = result["checkpoints"]
    assert sizes["runs/qwen3-8b/checkpoints/last.ckpt"] == 0 and sizes["runs/qwen3-8b/checkpoints/step=9.ckpt"] > 0
    assert any("training stalled" in line for line in result["checkpoint_lines"])
    assert not list(tmp_path.rglob("*.ckpt"))  # --clean: sizes recorded, files gone


def test_objective_ab_curves_pair_the_walk_with_the_argmax_and_the_lattice_recipes_check(tmp_path):
    """The A/B's LiLiCorr curves: walk minus argmax at each step both were logged, binned means; the lattice recipes
    name LiLiCorr settings the tiny drafter (width 128) accepts, each with a token_proj; the scaled recipe gives the
    tiny choice on the tiny target."""
    from dataclasses import replace
    from types import SimpleNamespace

    import pytest
    import yaml

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from objective_ab import RECIPES, binned, part_curves
    finally:
        sys.path.pop(0)
    from dflash_lightning.parts.lilicorr import LiLiCorrSettings

    log = tmp_path / "dflash/version_0/metrics.csv"
    log.parent.mkdir(parents=True)
    log.write_text("step,train/lilicorr/tau,train/lilicorr/argmax_tau,val/lilicorr/tau,val/lilicorr/argmax_tau\n"
                   "7,2.0,1.5,,\n15,3.0,2.0,,\n23,2.5,2.5,,\n23,,,4.0,3.0\n")
    curves = part_curves(tmp_path)
    assert curves["train/lilicorr/walk_minus_argmax"] == [[7, 0.5], [15, 1.0], [23, 0.0]]
    assert curves["val/lilicorr/walk_minus_argmax"] == [[23, 1.0]]
    assert binned(curves["train/lilicorr/walk_minus_argmax"], 16) == [[16, 0.75], [32, 0.0]]
    lattices = [name for name, r in RECIPES.items() if "model.drafter.lilicorr.token_proj_std" in r]
    assert {"lilicorr-conv-tokens", "lilicorr-conv-tokens-warm", "lilicorr-conv-tokens-scaled"} <= set(lattices)
    base = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    prefix = "model.drafter.lilicorr."
    for name in lattices:  # the scaled ones computed from the tiny target (H 128, embedding rows of norm 0.40)
        settings = {k[len(prefix):]: v(base) if callable(v) else v for k, v in RECIPES[name].items()
                    if k.startswith(prefix)}
        replace(LiLiCorrSettings(), **settings).check(SimpleNamespace(hidden_size=128, vocab_size=4032))
        assert settings["hidden_size"] != 128, name
        if "scaled" in name:  # the tiny choice again, from the rule
            assert settings == {"hidden_size": 64, "factor_dim": 128, "token_proj_std": pytest.approx(2.0, abs=0.02)}
    # Domino at ModelOpt's proportions of the width (H/4, H/16): on the tiny target, the tiny recipe's 32 and 8
    domino = {k: v(base) if callable(v) else v for k, v in RECIPES["domino-scaled"].items()}
    assert domino == RECIPES["domino"]


def test_supervised_slots_count_each_logged_fraction_for_the_steps_since_the_last():
    """The lattice's supervised slots against steps: a fraction logged at step 7 stands for steps 0-7, one at 15
    for 8-15, at anchors x slots a step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from objective_ab import supervised_slots
    finally:
        sys.path.pop(0)
    curve = [[7, 0.25], [15, 0.5], [19, 1.0]]
    reference, total, last = [], 0, -1
    for step, fraction in curve:
        total += sum(fraction * 96 * 15 for _ in range(last + 1, step + 1))
        reference.append([step, round(total)])
        last = step
    assert supervised_slots(curve, 96, 15) == reference == [[7, 2880], [15, 8640], [19, 14400]]


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("benchmarks/*.sh"),
                                                                              *ROOT.glob("tools/*.sh")]))
def test_shell_scripts_parse(script):
    """The GPU machine is the first to run some of these: a syntax error must not cost a call of device time."""
    done = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_decode_speed_cpu_smoke_times_both_ways_at_batch_1(tmp_path):
    """benchmarks/decode_speed.py --smoke: the tiny target alone and with a random drafter at batch 1 on the CPU (the
    CUDA-graph path's code, eager), equal outputs, both speeds, tau and the report file."""
    from benchmarks.decode_speed import main

    out = tmp_path / "speed.json"
    report = main(["--smoke", "--num-prompts", "2", "--warmup", "1", "--max-new-tokens", "6", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["mismatches"] == 0 and report["num_prompts"] == 2 and not report["cuda_graphs"]
    for mode in ("target_alone", "speculative"):
        assert report[mode]["tokens"] == 12 and report[mode]["tokens_per_second"] > 0
    assert report["speedup"] > 0 and 1 <= report["tau_pooled"] <= 4
