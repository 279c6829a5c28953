"""Fault injection on real runs: signals to `fit`, kills and full disks during saves, NaN features, damaged files."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from conftest import make_target
from helpers import RANKS_START, end_ranks
from lightning.pytorch import Callback
from test_cli import CONFIGS, write_conversations

from dflash_lightning.commands.cli import cli_main
from dflash_lightning.folder.reader import read_drafter
from dflash_lightning.folder.writer import ExportError, export_checkpoint
from dflash_lightning.long_runs.checkpointing import (
    AtomicCheckpointIO,
    CheckpointError,
    distributed_record,
    load_checkpoint,
    newest_complete_checkpoint,
)
from dflash_lightning.long_runs.distributed_checkpoint import save_distributed, shard_files
from dflash_lightning.long_runs.nonfinite import NonFiniteError
from dflash_lightning.long_runs.preemption import Preempted, Preemption

ROOT = Path(__file__).parents[1]
EVENTS: dict[str, list] = {}  # what the callbacks below saw, per test


class StepMarker(Callback):
    """Appends each finished step to a file (the test's clock) and slows steps so a signal lands mid-run."""

    def __init__(self, path: str, delay: float = 0.0) -> None:
        self.path, self.delay = path, delay

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step}\n")
        time.sleep(self.delay)


class SendSignal(Callback):
    """Sends a real signal to this process during the step that starts at `at_step`; keeps the module it ran."""

    module = trainer = None  # the last run's LightningModule and Trainer

    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step = signum, at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        SendSignal.module, SendSignal.trainer = pl_module, trainer
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


class Poison(Callback):
    """Writes NaN into the context features of the batches of `steps`; records the weights and optimizer state
    around the first poisoned step and the records of its batch."""

    def __init__(self, key: str, steps: list[int]) -> None:
        self.key, self.steps = key, steps

    def on_train_start(self, trainer, pl_module) -> None:  # poison right where TargetFeatures adds the features
        target = next(c for c in trainer.callbacks if type(c).__name__ == "TargetFeatures")
        add_features = target.on_train_batch_start

        def poisoned(trainer, pl_module, batch, batch_idx):
            add_features(trainer, pl_module, batch, batch_idx)
            self.poison(trainer, pl_module, batch)

        target.on_train_batch_start = poisoned

    def poison(self, trainer, pl_module, batch) -> None:
        if trainer.global_step in self.steps:
            batch["context_features"][0, 0] = float("nan")
            if trainer.global_step == self.steps[0]:
                ids = [i for i in batch["sample_ids"].tolist() if i >= 0]
                EVENTS[self.key] = [_snapshot(pl_module, trainer), trainer.datamodule.train_locations(ids)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step - 1 == self.steps[0]:
            EVENTS[self.key].append(_snapshot(pl_module, trainer))


def _snapshot(module, trainer) -> dict[str, torch.Tensor]:
    state = {f"w.{k}": v.detach().clone() for k, v in module.drafter.named_parameters()}
    for i, s in enumerate(trainer.optimizers[0].state.values()):
        state |= {f"opt.{i}.{k}": v.clone() for k, v in s.items()}
    return state


# ------------------------------------------------------------------------------------------- set-up


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults")
    return {"target": make_target(root / "target", layers=4, hidden=32, heads=2, kv_heads=1),
            "train": write_conversations(root / "train.jsonl", 40),
            "val": write_conversations(root / "val.jsonl", 8, seed=1)}


def fault_config(assets, folder: Path, max_steps: int = 4, callbacks: list[dict] | None = None,
                 checkpoints: Path | None = None, **checkpoint_args) -> Path:
    """The tiny config at test size, run in `folder`, checkpoints every 2 steps into `checkpoints`."""
    folder.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    config["target"]["path"] = str(assets["target"])
    config["data"].update(train_files=[str(assets["train"])], val_files=[str(assets["val"])], token_budget=256,
                          max_documents=8)
    config["model"].update(num_anchors=16, metrics_every=1)
    # a DFlash drafter: the small disk below is sized to its checkpoint (DFlash2's selector codebooks are larger)
    config["model"]["drafter"].update(num_layers=1, block_size=8, variant="dflash")
    config["trainer"].update(default_root_dir=str(folder), max_steps=max_steps, val_check_interval=1000,
                             limit_val_batches=1, log_every_n_steps=1, logger=False, enable_progress_bar=False)
    config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"] if "ModelCheckpoint" in c["class_path"]]
    config["trainer"]["callbacks"][0]["init_args"].update(
        dirpath=str(checkpoints or folder / "checkpoints"), every_n_train_steps=2, **checkpoint_args)
    config["trainer"]["callbacks"] += callbacks or []
    config["spec_eval"]["prompts"] = None
    path = folder / "input.yaml"  # not config.yaml, which the CLI writes there
    path.write_text(yaml.safe_dump(config))
    return path


def fit(config: Path, *extra: str):
    return cli_main(["fit", "--config", str(config), *extra])


def steps_in(folder: Path) -> dict[str, int]:
    return {p.name: int(load_checkpoint(p)["global_step"]) for p in sorted(folder.glob("*.ckpt"))}


# ------------------------------------------------------------------------------------------- 1: preemption


def test_sigterm_saves_the_step_exits_143_and_the_same_command_resumes(assets, tmp_path):
    """A real `fit` process gets SIGTERM mid-run: it checkpoints that step and exits 143; the same command then
    continues with the next step and ends at max_steps; the keep-2 rotation leaves only complete files."""
    marker = tmp_path / "steps.txt"
    config = fault_config(assets, tmp_path / "run", max_steps=10, callbacks=[
        {"class_path": "test_faults.StepMarker", "init_args": {"path": str(marker), "delay": 0.3}}])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    command = [sys.executable, "-m", "dflash_lightning", "fit", "--config", str(config)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not (marker.exists() and len(marker.read_text().split()) >= 3) and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out
    done = [int(s) for s in marker.read_text().split()]
    folder = tmp_path / "run" / "checkpoints"
    assert max(steps_in(folder).values()) == done[-1]  # the step in flight was finished and saved
    assert f"checkpoint of step {done[-1]}" in out

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stderr
    steps = [int(s) for s in marker.read_text().split()]
    assert steps == list(range(1, 11))  # every step once: none repeated, none skipped
    kept = steps_in(folder)
    assert kept["last.ckpt"] == 10 and len(kept) == 3, kept  # save_top_k: 2 step files + last
    assert not list(folder.glob(".*"))  # no unfinished writes left behind


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGINT])
def test_sigusr1_and_sigint_save_the_step_and_exit_with_a_retry_code(assets, tmp_path, signum):
    config = fault_config(assets, tmp_path, max_steps=6, callbacks=[
        {"class_path": "test_faults.SendSignal", "init_args": {"signum": int(signum), "at_step": 2}}])
    before = signal.getsignal(signum)  # Python's, or SIG_IGN where a shell started the run in the background
    with pytest.raises(Preempted) as stop:
        fit(config)
    assert stop.value.code == 128 + signum
    assert steps_in(tmp_path / "checkpoints") == {"last.ckpt": 3, "step=2.ckpt": 2, "step=3.ckpt": 3}
    assert signal.getsignal(signum) == before  # the handler the run found, restored
    # a scheduler's signal ends the process: the weights are not copied to the host first (release_for_exit);
    # Ctrl+C in a notebook keeps the trained module usable
    module = SendSignal.module
    weights = [t.numel() for t in [*module.parameters(), *module.buffers()]]
    weights += [p.grad.numel() for p in module.parameters() if p.grad is not None]
    assert (sum(weights) == 0) == (signum == signal.SIGUSR1), weights[:4]
    assert (not SendSignal.trainer.optimizers[0].state) == (signum == signal.SIGUSR1)  # its moments dropped too
    saved = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert min(t.numel() for t in saved["state_dict"].values()) > 0 and saved["optimizer_states"][0]["state"]
    if signum == signal.SIGINT:  # starting fresh on purpose keeps the old checkpoints aside
        cli = fit(config, "--preemption.resume=never", "--trainer.max_steps=1")
        assert cli.trainer.global_step == 1
        (aside,) = (tmp_path / "checkpoints").glob("previous-*")
        assert steps_in(aside) == {"last.ckpt": 3, "step=2.ckpt": 2, "step=3.ckpt": 3}


def test_a_signal_inside_a_gradient_accumulation_saves_at_the_next_optimizer_step(assets, tmp_path):
    """Signalled in the first of two micro-batches of step 3: the checkpoint is of step 4, on a step boundary (a
    resume from half an accumulation would step on the other half alone)."""
    config = fault_config(assets, tmp_path, max_steps=6, callbacks=[
        {"class_path": "test_faults.SendSignal", "init_args": {"signum": int(signal.SIGUSR1), "at_step": 3}}])
    with pytest.raises(Preempted):
        fit(config, "--trainer.accumulate_grad_batches=2")
    last = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 4
    assert last["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"] % 2 == 0


def _shipped_checkpoint_settings() -> dict[str, dict]:
    """Each distinct ModelCheckpoint setting of the shipped configs (the step period scaled to the test's), named by
    its first config, tiny.yaml first (a new config with its settings leaves the test ids, which marks name, alone)."""
    found: dict[str, dict] = {}
    for path in sorted(CONFIGS.glob("*.yaml"), key=lambda p: (p.stem != "tiny", p.stem)):
        callbacks = yaml.safe_load(path.read_text())["trainer"]["callbacks"]
        args = next(c["init_args"] for c in callbacks if "ModelCheckpoint" in c["class_path"])
        kept = {k: args[k] for k in ("save_top_k", "save_last", "monitor", "mode")}
        kept["periodic"] = "every_n_train_steps" in args
        found.setdefault(json.dumps(kept, sort_keys=True), kept | {"config": path.stem})
    return {v.pop("config"): v for v in found.values()}


SHIPPED = _shipped_checkpoint_settings()


def preempt_twice_then_finish(folder: Path, config_for, extra_callbacks: list[dict] | None = None) -> list[str]:
    """SIGTERM at steps 3 and 7, resume twice, finish at 13 (`config_for(run, callbacks)` writes each run's config,
    checkpoints into `folder`); checks `last` after each stop and no `-vN` or hidden file; returns the names."""
    for run, at_step in (("run1", 2), ("run2", 6), ("run3", None)):
        signal_cb = [] if at_step is None else [
            {"class_path": "test_faults.SendSignal", "init_args": {"signum": int(signal.SIGTERM), "at_step": at_step}}]
        config = config_for(run, (extra_callbacks or []) + signal_cb)
        if at_step is None:
            assert fit(config).trainer.global_step == 13
        else:
            with pytest.raises(Preempted):
                fit(config)
            assert load_checkpoint(folder / "last.ckpt")["global_step"] == at_step + 1
    names = sorted(p.name for p in folder.iterdir())
    assert not [n for n in names if "-v" in n or n.startswith(".")], names
    return names


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_last_is_the_newest_step_after_two_preemptions_and_resumes(assets, tmp_path, name):
    """Under each shipped config's checkpoint settings: preempted at steps 3 and 7 (between periodic saves),
    resumed twice, ended at 13 (not a periodic step): `last.ckpt` loads step 13, no `last-vN` file appears, and
    the folder holds at most K step files + `last`."""
    settings = dict(SHIPPED[name])
    top_k = settings["save_top_k"]
    settings.pop("periodic")
    folder = tmp_path / "checkpoints"

    def config_for(run: str, callbacks: list[dict]) -> Path:
        config = fault_config(assets, tmp_path / run, max_steps=13, callbacks=callbacks, checkpoints=folder,
                              **settings)
        if not SHIPPED[name]["periodic"]:  # tiny.yaml saves at validation: keep its own trigger, not a period
            spec = yaml.safe_load(config.read_text())
            spec["trainer"]["callbacks"][0]["init_args"].pop("every_n_train_steps")
            spec["trainer"]["val_check_interval"] = 4
            config.write_text(yaml.safe_dump(spec))
        return config

    names = preempt_twice_then_finish(folder, config_for)
    assert len(names) <= top_k + 1, names
    assert load_checkpoint(folder / "last.ckpt")["global_step"] == 13
    if settings["save_last"] == "link":
        assert (folder / "last.ckpt").is_symlink() and (folder / "last.ckpt").resolve().name == "step=13.ckpt"


def test_a_sigusr1_under_slurm_without_scontrol_still_exits_138(assets, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no scontrol binary, as in many containers
    config = fault_config(assets, tmp_path, max_steps=6, callbacks=[
        {"class_path": "test_faults.SendSignal", "init_args": {"signum": int(signal.SIGUSR1), "at_step": 2}}])
    with pytest.raises(Preempted) as stop:
        fit(config)
    assert stop.value.code == 138
    assert "could not requeue SLURM job 42: scontrol not runnable" in caplog.text


def _agree(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    callback = Preemption()
    callback._group = dist.group.WORLD
    callback.received = int(signal.SIGTERM) if rank == 1 else 0  # only rank 1 was signalled
    out[rank] = callback._agreed(SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=None)))[0]
    end_ranks()


def test_every_rank_stops_when_one_rank_is_signalled():
    out = mp.Manager().dict()
    mp.start_processes(_agree, args=(29541, out), nprocs=2, join=True, start_method=RANKS_START)
    assert dict(out) == {0: int(signal.SIGTERM), 1: int(signal.SIGTERM)}


def _failed_background_write(rank: int, port: int, out: dict) -> None:
    from dflash_lightning.long_runs.async_save import AsyncAtomicCheckpointIO

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    io = AsyncAtomicCheckpointIO()
    if rank == 0:  # only rank 0 writes the periodic saves under DDP

        def full_disk() -> None:
            raise CheckpointError("/ckpt/step=2000.ckpt: checkpoint not written: disk full")

        io.after_writes(full_disk)
        io._last.result()  # the write has failed by the end of the step
    callback = Preemption()
    callback._group = dist.group.WORLD
    trainer = SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=io))
    signum, failed = callback._agreed(trainer)  # what every step's end asks
    try:
        callback._wait_for_writes_on_every_rank(trainer)
        out[rank] = (signum, failed, None)
    except CheckpointError as err:
        out[rank] = (signum, failed, str(err))
    end_ranks()


def test_a_failed_background_write_stops_every_rank_at_the_same_step():
    """Rank 0's periodic write failed: every rank learns it at the step's end (one all-reduce) and raises its one
    line, none waits in a later collective (the gradients', the distributed preemption save's) for a rank 0 that
    is gone."""
    out = mp.Manager().dict()
    mp.start_processes(_failed_background_write, args=(29544, out), nprocs=2, join=True, start_method=RANKS_START)
    line = "/ckpt/step=2000.ckpt: checkpoint not written: disk full"
    assert dict(out) == {
        0: (0, True, line), 1: (0, True, f"{line} (a background write of rank 0; this rank stops too)")}


# ------------------------------------------------------------------------------------------- 4: atomic saves


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 256 KiB tmpfs (one tiny checkpoint fits, two do not); without mount rights, writes fail past 200 KiB."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    if not mounted:  # pragma: no cover - only where tmpfs cannot be mounted
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            used = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
            if hasattr(f, "write") and str(getattr(f, "name", "")).startswith(str(folder)) and used > 100 * 1024:
                f.write(b"\0" * 4096)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_what_was_needed(assets, tmp_path, small_disk):
    """The only checkpoint, last.ckpt, is rewritten at step 4 on a disk with no room for a second copy."""
    config = fault_config(assets, tmp_path, max_steps=4, checkpoints=small_disk, save_last=True, save_top_k=0)
    with pytest.raises(CheckpointError) as err:
        fit(config)  # last.ckpt at step 2 fits; its replacement at step 4 does not
    message = str(err.value)
    assert "\n" not in message and str(small_disk / "last.ckpt") in message
    assert "disk full" in message and "needs about" in message and "previous checkpoints are intact" in message
    assert steps_in(small_disk) == {"last.ckpt": 2}  # still whole and readable, nothing half-written beside it
    assert not list(small_disk.glob(".*"))


KILL_SCRIPT = """
import sys, torch
from dflash_lightning.long_runs.checkpointing import AtomicCheckpointIO
AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(2**25)}, "global_step": 9,
                                      "drafter_config": {}}, sys.argv[1])
"""


@pytest.mark.pinned_only(  # the kill is the system's, the partial file and its removal ours
    same_path_as="tests/test_faults.py::test_automatic_resume_falls_back_past_a_damaged_newest_checkpoint")
def test_kill_during_a_write_leaves_the_previous_checkpoint_readable(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 2,
                                          "drafter_config": {}}, path)
    before = path.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(path)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    partial = tmp_path / f".last.ckpt.{proc.pid}.partial"
    deadline = time.time() + 120
    while not (partial.exists() and partial.stat().st_size > 0) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)  # mid-write: 128 MiB take longer than the poll above
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and partial.exists()
    assert path.read_bytes() == before
    assert newest_complete_checkpoint(tmp_path) == path and not partial.exists()  # the leftover is cleaned up


# ------------------------------------------------------------------------------------------- 5: non-finite


def poison(key: str, steps: list[int]) -> list[dict]:
    return [{"class_path": "test_faults.Poison", "init_args": {"key": key, "steps": steps}}]


def test_nan_features_skip_the_update_and_training_goes_on(assets, tmp_path, caplog):
    config = fault_config(assets, tmp_path, max_steps=5, callbacks=poison("skip", [2]))
    cli = fit(config)
    assert "steps 0..4 of this fit: 4 trained, 1 skipped as non-finite (the first at step 2)" in caplog.text
    before, _, after = EVENTS["skip"]
    assert before.keys() == after.keys() and any(k.endswith("exp_avg") for k in before)
    for name in before:  # weights, moments and step count of the poisoned step: all as they were
        assert torch.equal(before[name], after[name]), name
    assert int(cli.trainer.callback_metrics["train/skipped_steps"]) == 1
    assert cli.trainer.global_step == 5
    final = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert all(torch.isfinite(v).all() for v in final["state_dict"].values())
    assert final["global_step"] == 5 and int(final["optimizer_states"][0]["state"][0]["step"]) == 4  # 1 skipped


def test_nan_features_under_stop_raise_naming_the_step_and_its_records(assets, tmp_path):
    config = fault_config(assets, tmp_path, max_steps=6, callbacks=poison("stop", [3]))
    with pytest.raises(NonFiniteError, match="at step 3") as err:
        fit(config, "--model.nonfinite=stop", "--model.metrics_every=4")  # the host reads the counts at step 4
    before, records = EVENTS["stop"][:2]
    assert records and all(r.startswith(f"{assets['train']}:") for r in records)  # file:line of each record
    assert ", ".join(records) in str(err.value)
    # The save after step 3 (every 2 steps) came before that read: refused, so no checkpoint passes the bad step
    # off as trained (a resume from it would go on as if nothing had happened).
    saved = [load_checkpoint(f)["global_step"] for f in (tmp_path / "checkpoints").glob("*.ckpt")]
    assert saved and max(saved) <= 3, saved


def test_a_fit_that_skipped_most_of_its_steps_fails_in_one_line(assets, tmp_path):
    """lr 1e30: the first step blows the weights up, every later one is non-finite and skipped, though never 16 in a
    row; more than half of the steps skipped is a failed run (exit 1), its checkpoints kept; half is not."""
    config = fault_config(assets, tmp_path / "a", max_steps=6)
    out = subprocess.run([sys.executable, "-m", "dflash_lightning", "fit", "--config", str(config), "--model.lr=1e30"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[-1].startswith("error: steps 0..5 of this fit: 1 trained, 5 skipped as non-finite (the first at "
                                "step 1): more than half, so the drafter barely trained; lower model.lr (1e+30)")
    assert load_checkpoint(tmp_path / "a" / "checkpoints" / "last.ckpt")["global_step"] == 6
    cli = fit(fault_config(assets, tmp_path / "b", max_steps=4, callbacks=poison("half", [1, 2])))
    assert cli.trainer.global_step == 4


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(assets, tmp_path):
    config = fault_config(assets, tmp_path, max_steps=8, callbacks=poison("row", [1, 2, 3, 4]))
    with pytest.raises(NonFiniteError, match="3 steps in a row, through step 3"):
        fit(config, "--model.max_nonfinite_in_a_row=3")


def test_nonfinite_weights_are_never_saved_nor_exported(tmp_path):
    ckpt = {"state_dict": {"drafter.fc.weight": torch.tensor([1.0, float("nan")])}, "global_step": 1,
            "drafter_config": {}}
    with pytest.raises(CheckpointError, match="refusing to save non-finite weights .*drafter.fc.weight"):
        AtomicCheckpointIO().save_checkpoint(ckpt, tmp_path / "x.ckpt")
    assert not list(tmp_path.iterdir())


def test_export_refuses_a_checkpoint_with_nonfinite_weights(assets, tmp_path):
    fit(fault_config(assets, tmp_path, max_steps=2))
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    ckpt["state_dict"]["drafter.norm.weight"][0] = float("inf")
    del ckpt["dflash_checksums"]
    torch.save(ckpt, tmp_path / "bad.ckpt")  # as if written by other code
    with pytest.raises(CheckpointError, match="non-finite weights .*norm.weight"):
        export_checkpoint(tmp_path / "bad.ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------------------- 7: damaged files


def damage(path: Path, kind: str, folder: Path) -> Path:
    data = path.read_bytes()
    out = folder / f"{kind}.ckpt"
    out.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                     "foreign": json.dumps({"not": "a checkpoint"}).encode()}[kind])
    return out


@pytest.fixture(scope="module")
def good_checkpoints(assets, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    fit(fault_config(assets, folder, max_steps=4))
    return folder


@pytest.mark.parametrize("kind", ["truncated", "empty", "foreign"])
def test_damaged_checkpoint_is_refused_in_one_line_by_export_evaluate_and_fit(good_checkpoints, tmp_path, kind):
    bad = damage(good_checkpoints / "checkpoints" / "step=4.ckpt", kind, tmp_path)
    expected = {"truncated": "truncated", "empty": "empty file", "foreign": "not a PyTorch checkpoint"}[kind]
    for load in (lambda: export_checkpoint(bad, tmp_path / "hf"), lambda: read_drafter(bad)):  # export, evaluate
        with pytest.raises(CheckpointError) as err:
            load()
        assert str(err.value).startswith(f"{bad}: {expected}") and "\n" not in str(err.value)
    if kind == "truncated":  # the Trainer's own loading (fit --ckpt_path, validate) goes through the same check
        config = good_checkpoints / "input.yaml"
        for command in ("fit", "validate"):
            with pytest.raises(CheckpointError, match=f"^{bad}: truncated"):
                cli_main([command, "--config", str(config), f"--ckpt_path={bad}"])
        run = subprocess.run([sys.executable, "-m", "dflash_lightning", "export", "--checkpoint", str(bad),
                              "--out", str(tmp_path / "hf")], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        # One line and nothing else: no import noise of optional packages (torchao's missing kernels on a CPU).
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: {expected}"), lines


def test_automatic_resume_falls_back_past_a_damaged_newest_checkpoint(good_checkpoints, tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("step=2.ckpt", "step=4.ckpt", "last.ckpt"):
        (folder / name).write_bytes((good_checkpoints / "checkpoints" / name).read_bytes())
    for name in ("step=4.ckpt", "last.ckpt"):  # the two newest: cut short, as by a crash without atomic writes
        (folder / name).write_bytes((folder / name).read_bytes()[:1000])
    config = tmp_path / "input.yaml"
    raw = yaml.safe_load((good_checkpoints / "input.yaml").read_text())
    raw["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(folder)
    raw["trainer"].update(max_steps=5, default_root_dir=str(tmp_path))
    config.write_text(yaml.safe_dump(raw))
    cli = fit(config)
    assert cli.trainer.global_step == 5
    assert f"resuming from {folder / 'step=2.ckpt'}" in caplog.text and "skipping damaged checkpoint" in caplog.text
    assert sorted(p.name for p in folder.glob("*.damaged")) == ["last.ckpt.damaged", "step=4.ckpt.damaged"]


def flip_a_bit_inside(path: Path, key: str, out: Path) -> Path:
    """A copy of a checkpoint with one bit flipped in the middle of a tensor's bytes (not in the zip's records)."""
    data = bytearray(path.read_bytes())
    raw = torch.load(path, weights_only=True)["state_dict"][key].numpy().tobytes()
    at = data.find(raw)
    assert at > 0 and data.find(raw, at + 1) < 0
    data[at + len(raw) // 2] ^= 0x10
    out.write_bytes(bytes(data))
    return out


@pytest.mark.pinned_only(  # the same loads as of a truncated file; the checksums that find the flipped bit are ours
    same_path_as="tests/test_faults.py::test_damaged_checkpoint_is_refused_in_one_line_by_export_evaluate_and_fit"
                 "[truncated]")
def test_flipped_bits_inside_a_tensor_are_refused_by_fit_export_and_evaluate(good_checkpoints, tmp_path):
    """torch.load reads such a file without a word; the checksums stored at the save name the damaged tensor."""
    good = good_checkpoints / "checkpoints" / "step=4.ckpt"
    assert len(load_checkpoint(good)["dflash_checksums"]) > 20  # weights and optimizer moments
    bad = flip_a_bit_inside(good, "drafter.fc.weight", tmp_path / "flipped.ckpt")
    expected = f"{bad}: damaged: tensor 'state_dict/drafter.fc.weight' fails its checksum"
    for load in (lambda: export_checkpoint(bad, tmp_path / "hf"), lambda: read_drafter(bad)):  # export, evaluate
        with pytest.raises(CheckpointError) as err:
            load()
        assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match=f"^{expected}"):
        cli_main(["fit", "--config", str(good_checkpoints / "input.yaml"), f"--ckpt_path={bad}"])
    run = subprocess.run([sys.executable, "-m", "dflash_lightning", "export", "--checkpoint", str(bad),
                          "--out", str(tmp_path / "hf")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), run.stderr[-2000:]
    assert not (tmp_path / "hf").exists()
    edited = torch.load(good, weights_only=True)
    del edited["optimizer_states"]  # an edit that keeps the checksums but changes no stored tensor's bytes
    torch.save(edited, tmp_path / "weights-only.ckpt")
    assert read_drafter(tmp_path / "weights-only.ckpt")[1].keys()


def test_automatic_resume_falls_back_past_flipped_bits_in_the_newest_checkpoint(good_checkpoints, tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "step=2.ckpt").write_bytes((good_checkpoints / "checkpoints" / "step=2.ckpt").read_bytes())
    for name in ("step=4.ckpt", "last.ckpt"):
        flip_a_bit_inside(good_checkpoints / "checkpoints" / name, "drafter.norm.weight", folder / name)
    raw = yaml.safe_load((good_checkpoints / "input.yaml").read_text())
    raw["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(folder)
    raw["trainer"].update(max_steps=3, default_root_dir=str(tmp_path))
    (tmp_path / "input.yaml").write_text(yaml.safe_dump(raw))
    cli = fit(tmp_path / "input.yaml")
    assert cli.trainer.global_step == 3 and f"resuming from {folder / 'step=2.ckpt'}" in caplog.text
    assert "tensor 'state_dict/drafter.norm.weight' fails its checksum" in caplog.text
    assert sorted(p.name for p in folder.glob("*.damaged")) == ["last.ckpt.damaged", "step=4.ckpt.damaged"]


def _save_on_two_ranks(rank: int, port: int, source: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    save_distributed(load_checkpoint(source), out)  # each rank its copy, as under DDP
    end_ranks()


@pytest.fixture(scope="module")
def two_rank_folder(good_checkpoints, tmp_path_factory) -> Path:
    """A real run's step 4 written as a distributed checkpoint by 2 gloo ranks (a DDP preemption save)."""
    out = tmp_path_factory.mktemp("dcp") / "step=4.ckpt"
    source = str(good_checkpoints / "checkpoints" / "step=4.ckpt")
    mp.start_processes(_save_on_two_ranks, args=(29543, source, str(out)), nprocs=2, join=True,
                       start_method=RANKS_START)
    return out


def copy_of(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def test_a_damaged_shard_of_a_distributed_checkpoint_is_refused_in_one_line_naming_the_file(
        good_checkpoints, two_rank_folder, tmp_path):
    """Flipped bits inside a tensor (found by its checksum), a cut shard, a shard unreadable at its size, a missing
    meta.pt: each refused by load, export and fit naming the file; the intact folder loads as its `.ckpt` did."""
    file = load_checkpoint(good_checkpoints / "checkpoints" / "step=4.ckpt")
    whole = load_checkpoint(two_rank_folder)
    assert all(torch.equal(whole["state_dict"][k], v) for k, v in file["state_dict"].items())
    assert sorted(p.name for p in two_rank_folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    where = shard_files(two_rank_folder)
    name = next(n for n, f in where.items() if f.name == "__1_0.distcp" and n.startswith("state_dict/"))
    flipped = copy_of(two_rank_folder, tmp_path / "flipped.ckpt")
    data = bytearray((flipped / "__1_0.distcp").read_bytes())
    raw = whole["state_dict"][name.split("/", 1)[1]].numpy().tobytes()
    at = data.find(raw)
    assert at > 0
    data[at + len(raw) // 2] ^= 0x10
    (flipped / "__1_0.distcp").write_bytes(bytes(data))
    cut = copy_of(two_rank_folder, tmp_path / "cut.ckpt")
    (cut / "__0_0.distcp").write_bytes((cut / "__0_0.distcp").read_bytes()[:1000])
    unreadable = copy_of(two_rank_folder, tmp_path / "unreadable.ckpt")
    data = bytearray((unreadable / "__0_0.distcp").read_bytes())
    data[:64] = bytes(64)  # the first tensor's zip header, the size kept
    (unreadable / "__0_0.distcp").write_bytes(bytes(data))
    no_meta = copy_of(two_rank_folder, tmp_path / "no-meta.ckpt")
    (no_meta / "meta.pt").unlink()
    expected = {
        flipped: f"{flipped / '__1_0.distcp'}: damaged: tensor '{name}' fails its checksum",
        cut: f"{cut / '__0_0.distcp'}: damaged: 1,000 bytes where",
        unreadable: f"{unreadable / '__0_0.distcp'}: damaged: unreadable",
        no_meta: f"{no_meta}: not a complete checkpoint folder (no meta.pt)",
    }
    for bad, line in expected.items():
        for load in (load_checkpoint, lambda path: export_checkpoint(path, tmp_path / "hf")):
            with pytest.raises(CheckpointError) as err:
                load(bad)
            assert str(err.value).startswith(line) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(CheckpointError, match=f"^{flipped / '__1_0.distcp'}: damaged"):
        cli_main(["fit", "--config", str(good_checkpoints / "input.yaml"), f"--ckpt_path={flipped}"])
    assert not (tmp_path / "hf").exists()


def test_a_resume_from_a_distributed_save_reports_its_write_time_against_the_grace_period(
        good_checkpoints, two_rank_folder, caplog):
    """The folder records how long its ranks took; the resumed run says so, and warns past `grace_s` (the estimate
    after a periodic save assumes one rank writing it all)."""
    caplog.set_level(logging.INFO)
    record = distributed_record(two_rank_folder)
    assert record["ranks"] == 2 and 0 < record["write_s"] < 60
    line = f"the checkpoint this run resumes from was written by 2 ranks in {record['write_s']:.1f} s"
    Preemption(grace_s=600)._report_resumed_save(SimpleNamespace(ckpt_path=str(two_rank_folder)))
    assert f"{line} (within preemption.grace_s=600)" in caplog.text
    caplog.clear()
    Preemption(grace_s=1e-6)._report_resumed_save(SimpleNamespace(ckpt_path=str(two_rank_folder)))
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith(f"preemption.grace_s=1e-06: {line}, longer than the scheduler waits")
    caplog.clear()
    Preemption(grace_s=1e-6)._report_resumed_save(SimpleNamespace(ckpt_path=str(good_checkpoints / "checkpoints"
                                                                                  / "step=4.ckpt")))
    assert not caplog.records  # a file: its write time is reported after the first save instead


def test_automatic_resume_takes_the_newest_of_files_and_folders_past_damaged_and_partial_ones(
        good_checkpoints, two_rank_folder, tmp_path, caplog):
    """A folder is a checkpoint like a file: the newest complete one wins; a damaged one is skipped (renamed
    `*.damaged`); the hidden partial folder a SIGKILL leaves mid-save is removed."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "step=2.ckpt").write_bytes((good_checkpoints / "checkpoints" / "step=2.ckpt").read_bytes())
    copy_of(two_rank_folder, folder / "step=4.ckpt")
    partial = copy_of(two_rank_folder, folder / ".step=6.ckpt.4242.partial")
    (partial / "meta.pt").unlink()  # killed before rank 0 finished
    assert newest_complete_checkpoint(folder) == folder / "step=4.ckpt"
    assert not partial.exists() and "a distributed checkpoint write that did not finish" in caplog.text
    shard = folder / "step=4.ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert newest_complete_checkpoint(folder) == folder / "step=2.ckpt"
    assert f"skipping damaged checkpoint {shard}: damaged" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == ["step=2.ckpt", "step=4.ckpt.damaged"]


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_a_damaged_checkpoint_behind_the_last_link_is_set_aside_whole(good_checkpoints, two_rank_folder, tmp_path,
                                                                      caplog, layout):
    """`save_last: link` (the GPU configs): `last.ckpt` links to a damaged `step=4.ckpt` (a file, or a DDP
    preemption folder). The automatic resume falls back to step 2 and renames the damaged step file or folder
    itself `*.damaged`, not only the link, so that no later resume picks it under its final name; the link, which
    only named it, goes."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "step=2.ckpt").write_bytes((good_checkpoints / "checkpoints" / "step=2.ckpt").read_bytes())
    if layout == "folder":
        copy_of(two_rank_folder, folder / "step=4.ckpt")
        shard = folder / "step=4.ckpt" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-10])
    else:
        data = (good_checkpoints / "checkpoints" / "step=4.ckpt").read_bytes()
        (folder / "step=4.ckpt").write_bytes(data[:1000])
    (folder / "last.ckpt").symlink_to("step=4.ckpt")
    assert newest_complete_checkpoint(folder) == folder / "step=2.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["step=2.ckpt", "step=4.ckpt.damaged"]
    assert (folder / "step=4.ckpt.damaged").is_dir() == (layout == "folder")
    assert f"renamed {folder / 'step=4.ckpt'} -> {folder / 'step=4.ckpt.damaged'}" in caplog.text
    assert newest_complete_checkpoint(folder) == folder / "step=2.ckpt"  # the next start: nothing left to skip


def test_tensor_checksums_are_the_same_rule_on_any_layout_and_catch_one_bit():
    """The stored value is the wrapping int64 sum of the bytes as words, whatever the dtype, shape or view."""
    from dflash_lightning.long_runs.checkpointing import tensor_checksum

    def reference(t: torch.Tensor) -> int:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        raw += bytes(-len(raw) % 8)
        words = [int.from_bytes(raw[i:i + 8], "little", signed=False) for i in range(0, len(raw), 8)]
        total = sum(words) % 2**64
        return total - 2**64 if total >= 2**63 else total

    base = torch.randn(7, 13)
    for t in (base, base.T, base[1:, 3:], base.bfloat16(), base[0, :3], torch.arange(5, dtype=torch.int32),
              torch.tensor([True, False, True]), torch.zeros(0)):
        assert int(tensor_checksum(t)) == reference(t), t.dtype
    flipped = base.clone()
    flipped.view(torch.int32)[3, 4] ^= 1 << 9
    assert tensor_checksum(flipped) != tensor_checksum(base)


# ------------------------------------------------------------------------------------------- 8: export writes


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def half_written_save(real):
    """safetensors' save_file that writes half the file, then fails as a full disk stops it."""
    def save_file(tensors, filename, metadata=None):
        real(tensors, filename, metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    return save_file


@pytest.mark.parametrize("fault", ["weights half written", "config after the weights"])
def test_export_failing_midway_leaves_the_existing_folder_as_it_was(good_checkpoints, tmp_path, monkeypatch, fault):
    import safetensors.torch

    import dflash_lightning.folder.writer as export_module

    out = export_checkpoint(good_checkpoints / "checkpoints" / "step=2.ckpt", tmp_path / "hf")
    (out / "README.md").write_text("the user's model card\n")
    before = folder_bytes(out)
    if fault == "weights half written":
        monkeypatch.setattr(safetensors.torch, "save_file", half_written_save(safetensors.torch.save_file))
        expected = ExportError, "export failed, the folder is as it was: .*No space left on device"
    else:
        def killed(*args, **kwargs):
            raise KeyboardInterrupt  # as a Ctrl-C between the weights and config.json
        monkeypatch.setattr(export_module, "hf_config", killed)
        expected = KeyboardInterrupt, ""
    with pytest.raises(expected[0], match=expected[1]):
        export_checkpoint(good_checkpoints / "checkpoints" / "step=4.ckpt", out)
    assert folder_bytes(out) == before  # the old weights with their own config.json, byte for byte
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # and no temporary folder left beside it


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "moved aside"])
def test_reexport_replaces_the_folder_and_carries_the_users_files_over(good_checkpoints, tmp_path, monkeypatch, swap):
    if not swap:  # a filesystem without renameat2's exchange (not Linux, some network filesystems)
        monkeypatch.setattr("dflash_lightning.long_runs.atomic._exchange", lambda a, b: False)
    ckpts = good_checkpoints / "checkpoints"
    out = export_checkpoint(ckpts / "step=2.ckpt", tmp_path / "hf")
    users = {"README.md": b"card\n", "tokenizer/tokenizer.json": b"{}"}
    (out / "tokenizer").mkdir()
    for name, data in users.items():
        (out / name).write_bytes(data)
    old = folder_bytes(out)
    fresh = folder_bytes(export_checkpoint(ckpts / "step=4.ckpt", tmp_path / "fresh"))
    assert export_checkpoint(ckpts / "step=4.ckpt", out) == out
    new = folder_bytes(out)
    assert new["model.safetensors"] != old["model.safetensors"]
    assert new == fresh | users
    assert sorted(os.listdir(tmp_path)) == ["fresh", "hf"]


def test_export_over_a_folder_with_other_weights_is_refused_naming_them(good_checkpoints, tmp_path):
    out = export_checkpoint(good_checkpoints / "checkpoints" / "step=2.ckpt", tmp_path / "hf")
    stale = ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]  # a sharded drafter was here
    for name in stale:
        (out / name).write_text("{}")
    before = folder_bytes(out)
    with pytest.raises(ExportError) as err:
        export_checkpoint(good_checkpoints / "checkpoints" / "step=4.ckpt", out)
    message = str(err.value)
    assert message.startswith(f"{out}: ") and all(name in message for name in stale) and "\n" not in message
    assert folder_bytes(out) == before and sorted(os.listdir(tmp_path)) == ["hf"]


def test_export_into_the_current_folder_is_refused_and_a_relative_one_works(good_checkpoints, tmp_path, monkeypatch):
    """The swap would leave the shell in a deleted folder; "sub/.." style names are the folder they resolve to."""
    ckpt = good_checkpoints / "checkpoints" / "step=2.ckpt"
    out = export_checkpoint(ckpt, tmp_path / "hf")
    before = folder_bytes(out)
    (out / "sub").mkdir()
    for cwd, name in ((out, "."), (out / "sub", ".."), (out, str(out))):
        monkeypatch.chdir(cwd)
        with pytest.raises(ExportError, match=f"^{out}: is the current folder or holds it"):
            export_checkpoint(ckpt, Path(name))
    monkeypatch.chdir(tmp_path)
    assert export_checkpoint(ckpt, Path("sub/../other")).resolve() == (tmp_path / "other").resolve()
    assert folder_bytes(out) == before and folder_bytes(tmp_path / "other") == before


def test_folder_moved_aside_comes_back_when_the_new_one_cannot_be_put_in_place(tmp_path, monkeypatch):
    """Where the filesystem cannot swap folders, a failure between the two renames restores the old folder."""
    from dflash_lightning.long_runs.atomic import write_dir_atomic

    folder = tmp_path / "hf"
    write_dir_atomic(folder, lambda tmp: (tmp / "config.json").write_text("old"))
    monkeypatch.setattr("dflash_lightning.long_runs.atomic._exchange", lambda a, b: False)
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(Path(dst).name)
        if len(calls) == 2:  # the new folder into place
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        write_dir_atomic(folder, lambda tmp: (tmp / "config.json").write_text("new"))
    assert calls[0].endswith(".old") and calls[1:] == ["hf", "hf"]
    assert folder_bytes(folder) == {"config.json": b"old"} and sorted(os.listdir(tmp_path)) == ["hf"]


def test_two_fresh_starts_in_one_second_move_their_checkpoints_to_separate_folders(tmp_path):
    from dflash_lightning.long_runs.checkpointing import move_aside

    for step in (1, 2):
        (tmp_path / f"step={step}.ckpt").write_bytes(b"x")
        aside = move_aside(tmp_path)
        assert (aside / f"step={step}.ckpt").exists()
    assert len(list(tmp_path.glob("previous-*"))) == 2


def test_ckpt_path_last_without_a_last_file_resumes_from_the_newest_step_or_refuses(assets, tmp_path):
    """Lightning's `--ckpt_path=last` looks for last.ckpt only and otherwise starts at step 0 with a warning: here it
    takes the newest complete checkpoint, and in a folder with none it refuses in one line."""
    from dflash_lightning.long_runs.checkpointing import CheckpointError

    config = fault_config(assets, tmp_path, max_steps=4, save_last=False, save_top_k=-1)
    fit(config)
    folder = tmp_path / "checkpoints"
    assert not (folder / "last.ckpt").exists() and max(steps_in(folder).values()) == 4
    cli = fit(config, "--ckpt_path=last", "--trainer.max_steps=6")
    assert cli.trainer.global_step == 6 and max(steps_in(folder).values()) == 6
    empty = fault_config(assets, tmp_path / "empty", max_steps=2, save_last=False)
    with pytest.raises(CheckpointError, match="--ckpt_path=last: no complete checkpoint"):
        fit(empty, "--ckpt_path=last")
