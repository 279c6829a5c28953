"""Background checkpoint writes (AsyncAtomicCheckpointIO) keep the guarantees of synchronous ones: real runs with
slowed, failing and killed writes, under the GPU configs' checkpoint settings."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_target
from lightning.pytorch import Callback
from test_cli import CONFIGS, write_conversations
from test_faults import ROOT, fault_config, fit, preempt_twice_then_finish, steps_in

import dflash_lightning.long_runs.async_save as async_save
import dflash_lightning.long_runs.checkpointing as checkpointing
from dflash_lightning.long_runs.async_save import AsyncAtomicCheckpointIO, HostCopy, expected_checkpoint_bytes
from dflash_lightning.long_runs.checkpointing import CheckpointError, load_checkpoint, newest_complete_checkpoint
from dflash_lightning.long_runs.preemption import Preempted

PLUGIN = "dflash_lightning.long_runs.async_save.AsyncAtomicCheckpointIO"
GPU_CONFIGS = sorted(p for p in [*CONFIGS.glob("*.yaml"), *CONFIGS.glob("stages/*.yaml")]  # the stages' too
                     if yaml.safe_load(p.read_text())["trainer"].get("accelerator") != "cpu")  # not tiny, smollm2
EVENTS: list[tuple[float, str, str]] = []  # (time, what, file name) from the worker and the training thread


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("async")
    return {"target": make_target(root / "target", layers=4, hidden=32, heads=2, kv_heads=1),
            "train": write_conversations(root / "train.jsonl", 40),
            "val": write_conversations(root / "val.jsonl", 8, seed=1)}


def gpu_checkpoint_settings() -> dict:
    """The GPU configs' ModelCheckpoint settings (one set: the configs agree) with the period scaled to 2 steps."""
    found = set()
    for path in GPU_CONFIGS:
        callbacks = yaml.safe_load(path.read_text())["trainer"]["callbacks"]
        args = next(c["init_args"] for c in callbacks if "ModelCheckpoint" in c["class_path"])
        found.add(json.dumps({k: args[k] for k in ("save_top_k", "save_last", "monitor", "mode")}, sort_keys=True))
    assert len(found) == 1, found
    return json.loads(found.pop())


def async_config(assets, folder: Path, max_steps: int, callbacks: list[dict] | None = None, **settings) -> Path:
    """The fault tests' tiny run with the GPU configs' checkpoint settings and background writes."""
    config = fault_config(assets, folder, max_steps=max_steps, callbacks=callbacks,
                          **(gpu_checkpoint_settings() | settings))
    spec = yaml.safe_load(config.read_text())
    spec["trainer"]["plugins"] = [{"class_path": PLUGIN}]
    config.write_text(yaml.safe_dump(spec))
    return config


class SlowWrites(Callback):
    """Makes every checkpoint write take `delay` s more (torch.save into the partial file, on the writer's
    thread; from the `started_at`-th on, when given) and records when writes end, files are removed and `last.ckpt`
    is linked; `fail_at`: the n-th write (1-based) fails as a full disk does, after 4 KiB; `started`: a file made
    when the `started_at`-th write is half written."""

    def __init__(self, delay: float = 0.0, fail_at: int = 0, started: str = "", started_at: int = 0) -> None:
        self.delay, self.fail_at, self.started, self.started_at = delay, fail_at, started, started_at

    def setup(self, trainer, pl_module, stage) -> None:
        real_save, real_link = torch.save, checkpointing.link_atomic
        real_remove = checkpointing.AtomicCheckpointIO.remove_checkpoint
        count = [0]

        def save(obj, f, *args, **kwargs):
            name = str(getattr(f, "name", ""))
            if not name.endswith(".partial"):
                return real_save(obj, f, *args, **kwargs)
            count[0] += 1
            if count[0] == self.fail_at:
                f.write(b"\0" * 4096)
                raise OSError(errno.ENOSPC, "No space left on device")
            data = io.BytesIO()
            real_save(obj, data, *args, **kwargs)
            half = len(data.getvalue()) // 2
            f.write(data.getvalue()[:half])  # half the file, then the delay: a kill lands mid-write
            f.flush()
            if count[0] == self.started_at:
                Path(self.started).write_text(name)
            time.sleep(self.delay if count[0] >= self.started_at else 0.0)
            f.write(data.getvalue()[half:])
            EVENTS.append((time.monotonic(), "written", Path(name).name.split(".ckpt.")[0].lstrip(".") + ".ckpt"))

        def remove(io, path):
            EVENTS.append((time.monotonic(), "removed", Path(path).name))
            real_remove(io, path)

        def link(link_path, target, suffix):
            EVENTS.append((time.monotonic(), "linked", Path(target).name))
            real_link(link_path, target, suffix)

        torch.save = save
        checkpointing.link_atomic = link
        checkpointing.AtomicCheckpointIO.remove_checkpoint = remove
        self._restore = (real_save, real_link, real_remove)

    def teardown(self, trainer, pl_module, stage) -> None:
        torch.save, checkpointing.link_atomic, checkpointing.AtomicCheckpointIO.remove_checkpoint = self._restore

    on_exception = teardown  # a run that raises skips the teardown hooks (same arguments: the exception)


class FolderWatch(Callback):
    """At every step end: the complete checkpoint files of the folder and where `last.ckpt` points."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        files = sorted(p.name for p in self.folder.glob("step=*.ckpt"))
        last = self.folder / "last.ckpt"
        EVENTS.append((time.monotonic(), "folder", json.dumps(
            {"step": trainer.global_step, "files": files, "last": last.resolve().name if last.exists() else None,
             "dangling": last.is_symlink() and not last.exists()})))


EXPECTED: list[int] = []


class Expected(Callback):
    """The expected checkpoint size at the start of the run, before any optimizer step."""

    def on_train_start(self, trainer, pl_module) -> None:
        EXPECTED[:] = expected_checkpoint_bytes(pl_module, trainer.optimizers)


def cb(name: str, **init_args) -> dict:
    return {"class_path": f"test_async_save.{name}", "init_args": init_args}


@pytest.fixture(autouse=True)
def fresh_events():
    EVENTS.clear()
    yield
    EVENTS.clear()


def first(what: str, name: str) -> float:
    return next(t for t, w, n in EVENTS if w == what and n == name)


# ------------------------------------------------------------------------------------------- in-process runs


def test_gpu_configs_name_the_background_checkpoint_writer():
    for path in GPU_CONFIGS:
        plugins = yaml.safe_load(path.read_text())["trainer"].get("plugins") or []
        assert any(p.get("class_path") == PLUGIN for p in plugins), path.name


def test_background_saves_wait_for_each_other_rotate_after_the_successor_and_link_last_after_its_target(
        assets, tmp_path):
    """Saves every 2 steps, each write 1.5 s (longer than 2 steps): every save is written, none dropped; the folder
    never holds more than K + 1 step files; a file leaves the rotation only after its successor is complete, and
    `last.ckpt` is switched only after its target is; the training thread waited for the save in flight."""
    folder = tmp_path / "checkpoints"
    top_k = gpu_checkpoint_settings()["save_top_k"]
    config = async_config(assets, tmp_path, max_steps=9, callbacks=[cb("SlowWrites", delay=1.5),
                                                                     cb("FolderWatch", folder=str(folder))])
    cli = fit(config)
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, AsyncAtomicCheckpointIO)
    steps = [2, 4, 6, 8, 9]  # periodic, then the end of the run (step 9 is not periodic)
    written = [n for _, w, n in EVENTS if w == "written"]
    assert written == [f"step={s}.ckpt" for s in steps]  # every save, in order
    assert len(io.timings) == len(steps) and any(t.wait_s > 0.5 for t in io.timings)  # the next save waited
    for before, after in zip(steps, steps[top_k:], strict=False):  # the keep-K rotation
        assert first("removed", f"step={before}.ckpt") > first("written", f"step={after}.ckpt")
    for s in steps:
        assert first("linked", f"step={s}.ckpt") > first("written", f"step={s}.ckpt")
    for _, what, detail in EVENTS:
        if what == "folder":
            seen = json.loads(detail)
            assert len(seen["files"]) <= top_k + 1 and not seen["dangling"], seen
    assert steps_in(folder) == {"last.ckpt": 9} | {f"step={s}.ckpt": s for s in steps[-top_k:]}
    assert (folder / "last.ckpt").is_symlink() and not list(folder.glob(".*"))


def test_the_preemption_save_waits_for_the_write_in_flight_and_its_own(assets, tmp_path, caplog):
    """SIGTERM in the step after a periodic save whose write is still running: the preemption save of the next
    step comes after it, and both are complete when the run says it exits (the log line) and exits 143."""
    folder = tmp_path / "checkpoints"
    config = async_config(assets, tmp_path, max_steps=10, callbacks=[
        cb("SlowWrites", delay=1.5),
        {"class_path": "test_faults.SendSignal", "init_args": {"signum": int(signal.SIGTERM), "at_step": 2}}])
    seen = {}

    class AtExit(logging.Handler):
        def emit(self, record):
            if "exiting with" in record.getMessage():
                seen["files"] = steps_in(folder)

    handler = AtExit()
    logging.getLogger("dflash_lightning.long_runs.preemption").addHandler(handler)
    try:
        with pytest.raises(Preempted) as stop:
            fit(config)
    finally:
        logging.getLogger("dflash_lightning.long_runs.preemption").removeHandler(handler)
    assert stop.value.code == 143
    assert seen["files"] == {"last.ckpt": 3, "step=2.ckpt": 2, "step=3.ckpt": 3}
    assert first("written", "step=2.ckpt") < first("written", "step=3.ckpt") < first("linked", "step=3.ckpt")


def test_two_preemptions_and_resumes_with_background_writes_end_with_last_at_the_newest_step(assets, tmp_path):
    """The sequence of tests/test_faults.py under the GPU configs' settings, with background writes."""
    folder = tmp_path / "checkpoints"
    top_k = gpu_checkpoint_settings()["save_top_k"]
    def config_for(run: str, callbacks: list[dict]) -> Path:
        config = async_config(assets, tmp_path / run, max_steps=13, callbacks=callbacks)
        spec = yaml.safe_load(config.read_text())
        spec["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(folder)
        config.write_text(yaml.safe_dump(spec))
        return config

    names = preempt_twice_then_finish(folder, config_for, [cb("SlowWrites", delay=0.3)])
    assert len(names) <= top_k + 1, names
    assert (folder / "last.ckpt").resolve().name == "step=13.ckpt"
    assert load_checkpoint(folder / "last.ckpt")["global_step"] == 13


def test_a_failed_preemption_write_is_an_error_not_a_retry(assets, tmp_path):
    """The write of the preemption save fails (full disk): the run stops with the disk error, not with 143 (which
    would tell the scheduler a checkpoint of that step exists)."""
    config = async_config(assets, tmp_path, max_steps=10, callbacks=[
        cb("SlowWrites", fail_at=2),
        {"class_path": "test_faults.SendSignal", "init_args": {"signum": int(signal.SIGTERM), "at_step": 2}}])
    with pytest.raises(CheckpointError, match=r"step=3\.ckpt: checkpoint not written \(disk full\)"):
        fit(config)
    assert steps_in(tmp_path / "checkpoints") == {"last.ckpt": 2, "step=2.ckpt": 2}


def test_a_failed_write_of_the_last_save_is_raised_when_the_run_ends(assets, tmp_path):
    """The write of the final step fails after training has ended: `fit` waits for it and raises its error."""
    config = async_config(assets, tmp_path, max_steps=4, callbacks=[cb("SlowWrites", delay=0.5, fail_at=2)])
    with pytest.raises(CheckpointError, match=r"step=4\.ckpt: checkpoint not written \(disk full\)"):
        fit(config)
    assert steps_in(tmp_path / "checkpoints") == {"last.ckpt": 2, "step=2.ckpt": 2}


def test_the_checkpoint_size_is_printed_at_the_start_and_the_write_rate_after_the_first_save(
        assets, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    config = async_config(assets, tmp_path, max_steps=4, callbacks=[cb("Expected")])
    fit(config, "--preemption.grace_s=0.001")
    text = caplog.text
    (start,) = [line for line in text.splitlines() if "checkpoints: about" in line]
    assert "written in the background (AsyncAtomicCheckpointIO)" in start
    weights, state = EXPECTED
    saved = load_checkpoint(tmp_path / "checkpoints" / "step=4.ckpt")
    assert weights == checkpointing.checkpoint_bytes({"s": saved["state_dict"]})
    optimizer = checkpointing.checkpoint_bytes(saved["optimizer_states"])
    assert 0 <= optimizer - state <= 64 * len(saved["optimizer_states"][0]["state"])  # + the step counts
    assert "checkpoint written: " in text and "MB/s); training stalled" in text
    per_save = [line for line in text.splitlines() if "written in the background in" in line]
    assert len(per_save) == 2 and all("stalled" in line and "checking and copying" in line for line in per_save)
    assert "of host memory reserved for background saves" in text  # after the first step, before any save
    warning = [r for r in caplog.records if "preemption.grace_s=0.001" in r.getMessage()]
    assert len(warning) == 1 and "\n" not in warning[0].getMessage()
    with pytest.raises(ValueError, match="preemption.grace_s must be > 0"):
        fit(config, "--preemption.grace_s=0")


def test_host_memory_reserved_after_the_first_step_serves_every_save_without_new_buffers():
    """`reserve` allocates one buffer per storage of the weights and moments; the saves then allocate nothing."""
    weights = {"a": torch.randn(10), "b": torch.randn(3, 4), "tied": None}
    weights["tied"] = weights["a"][2:5]  # a view: its storage is a's
    moments = [torch.randn(10), torch.randn(3, 4)]
    copy = HostCopy()
    added = copy.reserve([*weights.values(), *moments])
    assert added == sum(t.untyped_storage().nbytes() for t in (weights["a"], weights["b"], *moments))
    before = [b.data_ptr() for b in copy.buffers]
    for _ in range(2):
        snap = copy({"state_dict": weights, "optimizer_states": [{"state": {0: {"m": moments[0], "v": moments[1]}}}]})
        assert [b.data_ptr() for b in copy.buffers] == before
    assert torch.equal(snap["optimizer_states"][0]["state"][0]["v"], moments[1])
    assert copy.reserve([*weights.values(), *moments]) == 0


def test_host_copy_is_a_snapshot_keeps_shared_storages_and_reuses_its_buffers():
    base = torch.arange(12.0)
    ckpt = {"state_dict": {"a": base, "view": base[3:6]}, "optimizer_states": [{"state": {0: {"m": base * 2}}}],
            "global_step": 3, "names": ("x", [torch.ones(2)])}
    copy = HostCopy()
    snap = copy(ckpt)
    base.add_(100)  # the next optimizer step
    assert torch.equal(snap["state_dict"]["a"], torch.arange(12.0))
    assert torch.equal(snap["state_dict"]["view"], torch.arange(3.0, 6.0))
    storage = {k: v.untyped_storage().data_ptr() for k, v in snap["state_dict"].items()}
    assert storage["view"] == storage["a"]
    assert snap["global_step"] == 3 and snap["names"][0] == "x" and torch.equal(snap["names"][1][0], torch.ones(2))
    buffers = [b.data_ptr() for b in copy.buffers]
    again = copy(ckpt)
    assert [b.data_ptr() for b in copy.buffers] == buffers  # no new host memory per save
    assert torch.equal(again["state_dict"]["a"], base)


# ------------------------------------------------------------------------------------------- real processes


def run_fit(config: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    return subprocess.Popen([sys.executable, "-m", "dflash_lightning", "fit", "--config", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


BACKGROUND = ("tests/test_async_save.py::"
              "test_background_saves_wait_for_each_other_rotate_after_the_successor_and_link_last_after_its_target")


@pytest.mark.pinned_only(same_path_as=BACKGROUND)  # the failure is injected into our writer
def test_a_full_disk_in_a_background_write_stops_the_run_in_one_line_and_keeps_the_previous_files(assets, tmp_path):
    """`python -m dflash_lightning fit`: the third save's write fails with ENOSPC on the writer's thread; the run
    stops at the next step with exit 1 and one `error:` line naming the file; the rotation deleted nothing for it
    (step 2 stays), `last.ckpt` still points at step 4 and no partial file is left."""
    folder = tmp_path / "checkpoints"
    marker = tmp_path / "steps.txt"
    config = async_config(assets, tmp_path, max_steps=10, save_top_k=2, callbacks=[
        cb("SlowWrites", fail_at=3),
        {"class_path": "test_faults.StepMarker", "init_args": {"path": str(marker), "delay": 0.2}}])
    proc = run_fit(config)
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith(f"error: {folder / 'step=6.ckpt'}: checkpoint not written (disk full)"), lines[-3:]
    assert "the previous checkpoints are intact" in lines[-1]
    assert marker.read_text().split()[-1] == "7"  # stopped at the step after the failure, not at the next save
    assert steps_in(folder) == {"last.ckpt": 4, "step=2.ckpt": 2, "step=4.ckpt": 4}
    assert not list(folder.glob(".*"))


@pytest.mark.pinned_only(same_path_as=BACKGROUND)  # the kill is the system's, the partial file ours
def test_a_kill_during_a_background_write_leaves_the_previous_checkpoints_and_no_partial_at_a_final_name(
        assets, tmp_path):
    """SIGKILL of a `fit` process while the second save is written in the background (training goes on meanwhile):
    the first checkpoint and `last.ckpt` load; the partial is only at its hidden name and the next start removes it
    and resumes from step 2."""
    folder = tmp_path / "checkpoints"
    started = tmp_path / "started.txt"
    marker = tmp_path / "steps.txt"
    config = async_config(assets, tmp_path, max_steps=40, callbacks=[
        cb("SlowWrites", delay=60.0, started=str(started), started_at=2),
        {"class_path": "test_faults.StepMarker", "init_args": {"path": str(marker), "delay": 0.05}}])
    proc = run_fit(config)
    deadline = time.time() + 240
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    while len(marker.read_text().split()) < 6 and time.time() < deadline:  # the training thread is not blocked
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    partial = Path(started.read_text())
    assert partial.exists() and partial.name.startswith(".step=4.ckpt.")
    assert max(int(s) for s in marker.read_text().split()) >= 6  # steps went on during the write
    assert steps_in(folder) == {"last.ckpt": 2, "step=2.ckpt": 2}  # every name that is not hidden loads
    assert newest_complete_checkpoint(folder) == folder / "last.ckpt" and not partial.exists()


def test_a_background_failure_raised_with_another_error_is_logged_not_lost(tmp_path, caplog):
    io = AsyncAtomicCheckpointIO()
    (tmp_path / "a-file").write_text("")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1, "drafter_config": {}},
                       tmp_path / "a-file" / "x.ckpt")  # its folder cannot be made: the write fails
    while io._last is not None and not io._last.done():
        time.sleep(0.01)
    try:
        raise RuntimeError("the error that stops the run")
    except RuntimeError:
        io.teardown()  # as Lightning's teardown in its exception handler
    assert "a background checkpoint write failed too" in caplog.text and "a-file" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_a_background_save_of_gpu_tensors_checks_and_checksums_them_before_copying(tmp_path, monkeypatch):
    """GPU tensors (CPU ones standing in): non-finite weights are found before the copy and fail the save as a failed
    write does (nothing copied or written; every rank stops at the step's end); the checksums taken before the copy
    are the ones the file holds, and they verify on load."""
    monkeypatch.setattr(async_save, "on_gpu", lambda state_dict: True)
    io = AsyncAtomicCheckpointIO()
    nan = {"state_dict": {"w": torch.tensor([1.0, float("nan")])}, "global_step": 1}
    io.save_checkpoint(nan, tmp_path / "nan.ckpt")
    io._last.result()
    assert io.failed and not io.timings and not io.host_copy.buffers and not list(tmp_path.iterdir())
    with pytest.raises(CheckpointError, match="refusing to save non-finite weights .*w \\(1\\)"):
        io.wait()
    io = AsyncAtomicCheckpointIO()
    state = {"state_dict": {"w": torch.arange(6.0), "v": torch.ones(3, dtype=torch.bfloat16)}, "global_step": 2,
             "drafter_config": {}}
    io.save_checkpoint(state, tmp_path / "ok.ckpt")
    io.wait()
    saved = torch.load(tmp_path / "ok.ckpt", weights_only=True)
    assert saved[checkpointing.CHECKSUMS_KEY] == checkpointing.tensor_checksums(state)
    assert torch.equal(load_checkpoint(tmp_path / "ok.ckpt")["state_dict"]["w"], torch.arange(6.0))
    io.teardown()
