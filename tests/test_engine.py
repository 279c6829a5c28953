"""The engine placement's client against a stand-in engine (tests/fake_engine.py): the layout of a row's features,
retries with a deadline, one error line naming the engine, settings refused at start. The real vLLM engine's
features are tested in tests/test_engine_vllm_features.py (the engine part of .ci/run)."""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fake_engine import states_of

from dflash_lightning.config import ConfigError
from dflash_lightning.target_model.engine import (
    EngineClient,
    EngineError,
    EngineExtractor,
    EngineProcess,
    aux_layer_ids,
    final_norm,
    serve_command,
)

ROOT = Path(__file__).parents[1]
TINY = ROOT / "dflash_lightning/assets/tiny/target_model"
FAKE = Path(__file__).parent / "fake_engine.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake(tmp_path):
    """Starts a fake engine: fake(mode, aux_ids, limit) -> its URL; all are stopped at the end."""
    started = []

    def start(mode: str, aux_ids: list[int], limit: int = 0, hidden: int = 16) -> str:
        port = free_port()
        cmd = [sys.executable, str(FAKE), str(port), str(tmp_path / "hs"), str(hidden), json.dumps(aux_ids), mode,
               str(limit)]
        started.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}/v1"
        EngineClient(url, aux_ids, hidden, deadline_s=60).connect()
        return url

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_a_rows_features_are_its_segments_hidden_states_in_the_in_process_layout(fake, tmp_path):
    """Each document (and the padding tail) is one request; layer id j is the engine's aux id j + 1, K*H wide in
    layer-id order; the final hidden state is the target's own norm of aux id L; the files are removed."""
    served = [1, 2, 3, 4, 5, 6]  # an engine may extract more layers than one drafter takes
    url = fake("ok", served, hidden=128)
    layer_ids = [2, 0]
    client = EngineClient(url, aux_layer_ids(layer_ids, 6, True), 128).connect()
    norm = final_norm(str(TINY), torch.float32)
    extractor = EngineExtractor(client, layer_ids, torch.float32, norm)
    ids = torch.randint(3, 4000, (40,))
    pos = torch.cat([torch.arange(17), torch.arange(9), torch.arange(14)])  # 2 documents and a padding tail
    out = extractor.extract(ids, pos)
    expected = torch.cat([states_of(ids[a:b].tolist(), 6, 128) for a, b in ((0, 17), (17, 26), (26, 40))])
    torch.testing.assert_close(out["context_features"], torch.cat([expected[:, 2], expected[:, 0]], -1),
                               rtol=0, atol=0)
    from transformers import AutoModel
    reference = AutoModel.from_pretrained(TINY, dtype=torch.float32).norm  # the target's norm, loaded whole
    torch.testing.assert_close(out["final_hidden"], reference(expected[:, 5]), rtol=0, atol=0)
    assert not list((tmp_path / "hs").iterdir())  # read, then removed: nothing piles up


@pytest.mark.parametrize(("mode", "said"), [
    ("die_after", "Connection refused"),  # the engine is gone
    ("hang_after", "timed out"),  # the engine takes the request and never answers
    ("malformed", "hidden states (2, 1, 16) of 3 tokens, expected (3, 1, 16) of the request's 3"),
    ("no_path", "without kv_transfer_params.hidden_states_path"),
])
def test_a_failing_engine_is_retried_until_the_deadline_then_named(fake, mode, said):
    url = fake(mode, [1])
    client = EngineClient(url, [1], 16, request_timeout_s=0.5, deadline_s=2.0).connect()
    start = time.monotonic()
    with pytest.raises(EngineError, match=rf"^engine {url}: no valid hidden states for a 3-token document after "
                                          rf"\d+ tries in 2 s \(last: .*{re.escape(said)}") as err:
        client.hidden_states([5, 6, 7])
    assert time.monotonic() - start < 5  # the deadline holds
    assert "\n" not in str(err.value)  # one line


def test_a_flaky_engine_is_retried_to_success(fake):
    url = fake("flaky", [1])
    client = EngineClient(url, [1], 16, deadline_s=10.0).connect()
    torch.testing.assert_close(client.hidden_states([5, 6, 7]), states_of([5, 6, 7], 1, 16))


def test_an_engine_without_the_layers_asked_for_is_refused_with_the_flag(fake):
    url = fake("ok", [1, 3])
    client = EngineClient(url, [1, 2], 16).connect()
    with pytest.raises(ConfigError, match=r"extracts eagle_aux_hidden_state_layer_ids \[1, 3\], these features "
                                          r"need \[1, 2\] \(missing \[2\]\).*--speculative-config"):
        client.hidden_states([5, 6])


def test_a_document_longer_than_the_engines_context_is_refused_naming_the_flag(fake):
    client = EngineClient(fake("ok", [1]), [1], 16).connect()
    with pytest.raises(ConfigError, match="--max-model-len 4096, a document of 4096 tokens needs 4097"):
        client.hidden_states(list(range(4096)))


def test_an_engine_command_that_would_drop_features_is_refused_before_it_starts(tmp_path):
    with pytest.raises(ConfigError, match="target.engine_command: add --no-enable-prefix-caching "
                                          "--no-enable-chunked-prefill"):
        EngineProcess("vllm serve x --enable-prefix-caching", tmp_path / "log")
    assert not (tmp_path / "log").exists()


def test_serve_command_asks_for_each_layer_id_plus_one_and_the_last_residual():
    cmd = serve_command("m", [1, 9, 17], 36, True)
    speculative = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 10, 18, 36]
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "DFlashHiddenStatesConnector"
    assert "--no-enable-prefix-caching" in cmd and "--no-enable-chunked-prefill" in cmd


@pytest.mark.pinned_only(same_path_as="tests/test_faults.py::test_a_fit_that_skipped_most_of_its_steps_fails_in_one_line")
def test_fit_whose_engine_dies_exits_1_with_one_line_naming_it(tmp_path):
    """`fit` starts the engine from target.engine_command, trains on it, and when it dies mid-run retries until the
    deadline, then stops with exit 1 and one error line naming the engine."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    # the tiny config's drafter (1 layer of 6: layer id 3) needs aux id 4; the engine dies after 40 documents
    command = (f"{sys.executable} {FAKE} {port} {tmp_path / 'hs'} 128 '[4]' die_after 40 "
               "--no-enable-prefix-caching --no-enable-chunked-prefill")
    cmd = [sys.executable, "-m", "dflash_lightning", "fit", "--config", "configs/tiny.yaml", "--trainer.max_steps=50",
           "--target.placement=engine", f"--target.engine_urls=[{url}]", f"--target.engine_command={command}",
           "--target.engine_deadline_s=3", "--target.engine_request_timeout_s=1", "--trainer.enable_progress_bar=false",
           f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.callbacks=[]",
           "--spec_eval.every_n_steps=0", "--trainer.limit_val_batches=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith(f"error: engine {url}: no valid hidden states"), errors
    assert (tmp_path / "engine.log").read_text().startswith(f"$ {command}")


@pytest.mark.pinned_only(same_path_as="tests/test_resume.py::test_resumed_losses_equal_an_uninterrupted_run_bitwise")
def test_a_fit_fed_by_an_engine_resumes_mid_epoch_exactly(fake, tmp_path):
    """Rows are fetched ahead of the trainer, yet a run stopped after 3 steps (mid-epoch: 5 rows an epoch) and
    resumed from that checkpoint trains the same rows in the same order: the same losses, bitwise."""
    from test_resume import fit, resume_config  # noqa: F401 (the fixture's body, called below)

    config = resume_config.__wrapped__(tmp_path_factory=_Factory(tmp_path))
    url = fake("ok", [3], hidden=32)  # the small target: 4 layers of 32, drafter layer id 2
    engine = ["--target.placement=engine", f"--target.engine_urls=[{url}]", "--target.engine_streams=2",
              "--target.prefetch=3"]
    _, full, ckpts = fit(config, tmp_path / "full", *engine)
    assert [s for s, _ in full] == list(range(8))
    _, resumed, _ = fit(config, tmp_path / "from3", f"--ckpt_path={ckpts[3]}", *engine)
    assert resumed == full[3:]


@pytest.mark.pinned_only(
    same_path_as="tests/test_faults.py::test_last_is_the_newest_step_after_two_preemptions_and_resumes[tiny]")
def test_a_preempted_fit_fed_by_an_engine_resumes_to_the_same_weights(fake, tmp_path):
    """SIGTERM in step 4 (mid-epoch, rows fetched ahead): the preemption checkpoint is written and the restarted
    command ends at step 8 with the weights of an uninterrupted run, bitwise."""
    from test_resume import SIGTERM_AT_3, fit, resume_config  # noqa: F401

    from dflash_lightning.long_runs.preemption import Preempted

    config = resume_config.__wrapped__(tmp_path_factory=_Factory(tmp_path))
    url = fake("ok", [3], hidden=32)
    engine = ["--target.placement=engine", f"--target.engine_urls=[{url}]"]
    _, _, full = fit(config, tmp_path / "full", *engine)
    with pytest.raises(Preempted):
        fit(config, tmp_path / "run", *engine, SIGTERM_AT_3)
    _, _, again = fit(config, tmp_path / "run", *engine)
    logs = sorted((tmp_path / "run").rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    steps = [int(r["step"]) for r in csv.DictReader(logs[-1].open()) if r.get("train/loss")]
    assert steps == [4, 5, 6, 7], steps  # the restart resumed after the preempted step 4, it did not start over
    final, resumed = (torch.load(c[8], weights_only=True)["state_dict"] for c in (full, again))
    assert all(torch.equal(resumed[n], w) for n, w in final.items())


class _Factory:
    """tmp_path_factory's `mktemp` for a module fixture's body called in one test."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir()
        return path


@pytest.mark.pinned_only(  # the engines are ours (HTTP), the DDP fit Lightning's, as there
    same_path_as="tests/test_distributed.py::test_two_process_ddp_fit_through_the_cli[sharded-dflash2]")
def test_two_ddp_ranks_use_an_engine_each(tmp_path):
    """`--trainer.strategy=ddp --trainer.devices=2` (gloo) fed by 2 engines, one per rank. Ranks share engines by the
    same dealing (`rank_devices`, as target devices: tests/test_target.py); one run costs a minute here."""
    engines = 2
    ports = [free_port() for _ in range(engines)]
    fakes = [subprocess.Popen([sys.executable, str(FAKE), str(p), str(tmp_path / "hs"), "128", "[4]", "ok"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    urls = [f"http://127.0.0.1:{p}/v1" for p in ports]
    cmd = [sys.executable, "-m", "dflash_lightning", "fit", "--config", "configs/tiny.yaml", "--trainer.strategy=ddp",
           "--trainer.devices=2", "--trainer.max_steps=2", "--target.placement=engine",
           f"--target.engine_urls=[{','.join(urls)}]", f"--trainer.default_root_dir={tmp_path}",
           "--trainer.logger=false", "--trainer.callbacks=[]", "--spec_eval.every_n_steps=0",
           "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        for process in fakes:
            process.kill()
            process.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    asked = [len((tmp_path / f"requests-{p}.log").read_text().splitlines()) for p in ports]
    assert all(n > 0 for n in asked), asked  # each rank used its own


def test_engine_settings_without_the_engine_placement_are_refused():
    from dflash_lightning.target_model import TargetFeatures

    with pytest.raises(ConfigError, match="used by placement 'engine' only, placement is 'colocated'"):
        TargetFeatures(str(TINY), engine_urls=["http://x:8000/v1"])
    with pytest.raises(ConfigError, match="target.engine_urls: name the engines' URLs"):
        TargetFeatures(str(TINY), placement="engine")
