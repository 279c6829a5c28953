"""Resuming real fits from real checkpoints: bitwise the same losses, the same data, changed settings refused."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml
from conftest import fine_tune
from test_cli import small_config

from dflash_lightning.blocks import anchor_seed
from dflash_lightning.commands.cli import cli_main
from dflash_lightning.long_runs.checkpointing import _named_tensors, distributed_record, load_checkpoint
from dflash_lightning.long_runs.resume import CONTENT, RECORD_KEY, ResumeError, compare
from dflash_lightning.target_model.fingerprints import TargetChangedError


@pytest.fixture(scope="module")
def resume_config(tmp_path_factory) -> Path:
    """A tiny run of 5 packed rows per epoch, losses logged every step, a checkpoint after every step."""
    root = tmp_path_factory.mktemp("resume")
    config = small_config(root, 12)
    config["model"]["metrics_every"] = 1
    config["trainer"].update(max_steps=8, log_every_n_steps=1, limit_val_batches=0, val_check_interval=None,
                             check_val_every_n_epoch=None, enable_progress_bar=False, enable_model_summary=False)
    config["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                       "init_args": {"every_n_train_steps": 1, "save_top_k": -1}}]
    config["spec_eval"] = {"prompts": None, "every_n_steps": 0}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit_args(config: Path, run: Path, *args: str) -> list[str]:
    return ["fit", "--config", str(config), f"--trainer.default_root_dir={run}",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={run}",
            f"--trainer.callbacks.dirpath={run / 'ckpt'}", *args]


def results(run: Path) -> tuple[list[tuple[int, float]], dict[int, Path]]:
    """A finished run's per-step (step, loss) pairs and its checkpoints by step."""
    rows = list(csv.DictReader(next(run.rglob("metrics.csv")).open()))
    losses = [(int(r["step"]), float(r["train/loss"])) for r in rows if r.get("train/loss")]
    ckpts = {load_checkpoint(p, mmap=True, verify=False)["global_step"]: p for p in (run / "ckpt").glob("*.ckpt")}
    return losses, ckpts


def fit(config: Path, run: Path, *args: str):
    """One `fit` through the CLI into its own folder: (cli, per-step (step, loss) pairs, checkpoints by step)."""
    cli = cli_main(fit_args(config, run, *args))
    return cli, *results(run)


def test_resumed_losses_equal_an_uninterrupted_run_bitwise(resume_config, tmp_path, caplog):
    """Stopped after k steps and resumed from that step's checkpoint: the same losses, steps and weights, bitwise.

    An epoch has 5 rows: from step 3 the continuation crosses the epoch end, step 5 is the epoch's last batch,
    step 6 lies in the second epoch.
    """
    _, full, ckpts = fit(resume_config, tmp_path / "full")
    assert [s for s, _ in full] == list(range(8))
    final = torch.load(ckpts[8], weights_only=True)
    for k in (3, 5, 6):
        cli, resumed, again = fit(resume_config, tmp_path / f"from{k}", f"--ckpt_path={ckpts[k]}")
        assert "changed settings" not in caplog.text  # the record survives a save and a load unchanged
        assert "fingerprint" not in caplog.text  # the same target: no word about it
        assert resumed == full[k:], k  # (logged step, loss) pairs, floats compared exactly
        state = torch.load(again[8], weights_only=True)
        assert all(torch.equal(state["state_dict"][n], w) for n, w in final["state_dict"].items())
        moments = [s["optimizer_states"][0]["state"][0]["exp_avg"] for s in (state, final)]
        assert torch.equal(*moments)
        assert state["lr_schedulers"] == final["lr_schedulers"] and state["epoch"] == final["epoch"] == 1


@pytest.fixture(scope="module")
def step3(resume_config, tmp_path_factory) -> Path:
    """The checkpoint of a real run stopped after 3 steps."""
    run = tmp_path_factory.mktemp("step3")
    return fit(resume_config, run, "--trainer.max_steps=3")[2][3]


def test_changes_to_what_is_trained_are_refused_before_any_step(resume_config, step3, tmp_path):
    """Shape, loss and anchor settings typed on resume are neither replaced by the checkpoint's nor applied."""
    changed = ["--model.drafter.num_layers=2", "--model.drafter.gamma=3.0", "--model.num_anchors=8",
               "--data.max_documents=4", "--model.objective=kl", "--model.loss_weights=decay",
               "--model.drafter.variant=dflash"]
    with pytest.raises(ResumeError) as refused:
        fit(resume_config, tmp_path / "a", f"--ckpt_path={step3}", *changed)
    message = str(refused.value)
    for line in ("drafter.num_layers: 1 -> 2", "drafter.gamma: None -> 3.0", "model.num_anchors: 16 -> 8",
                 "data.max_documents: 8 -> 4", "drafter.target_layer_ids: [2] -> [1, 1]",
                 "model.objective: 'ce' -> 'kl'", "model.loss_weights: 'dpace' -> 'decay'",
                 "drafter.variant: 'dflash2' -> 'dflash'"):
        assert line in message, message
    assert str(step3) in message and "size mismatch" not in message
    assert not (tmp_path / "a" / "ckpt").exists()  # no step ran


def test_a_changed_variant_is_named_before_the_settings_it_strands(resume_config, tmp_path):
    """A DSpark checkpoint resumed as DFlash2 on its own settings (the DSpark heads' left in): refused naming the
    changed variant first, with --ckpt_path and by the automatic resume; a new run is told only of the setting."""
    from dflash_lightning.config import UnusedPartSettings

    dspark = ["--model.drafter.variant=dspark", "--model.loss_weights=decay",
              "--model.drafter.dspark_heads.markov_rank=8"]
    _, _, ckpts = fit(resume_config, tmp_path / "a", *dspark, "--trainer.max_steps=1")
    stranded = "model.drafter.dspark_heads.markov_rank=8: variant 'dflash2' has no dspark_heads part"
    for resumed in ([f"--ckpt_path={ckpts[1]}"], []):
        with pytest.raises(ResumeError, match=rf"^cannot resume from {ckpts[1]}: model.drafter.variant 'dspark' -> "
                                              rf"'dflash2' changes what is trained; .* Then also: {stranded}"):
            fit(resume_config, tmp_path / "a", *dspark, "--model.drafter.variant=dflash2", *resumed)
    with pytest.raises(UnusedPartSettings, match=f"^{stranded}"):
        fit(resume_config, tmp_path / "b", *dspark, "--model.drafter.variant=dflash2")


def test_a_fine_tuned_target_is_refused_in_one_line_unless_accepted(resume_config, step3, tmp_path, caplog):
    """Same config and shapes, one weight moved: refused by fit and validate naming the checkpoint and the target;
    accepted on purpose with one logged line, and the new checkpoints then record the new target."""
    tuned = fine_tune(Path(yaml.safe_load(resume_config.read_text())["target"]["path"]), tmp_path / "tuned")
    for command in ("fit", "validate"):
        with pytest.raises(TargetChangedError) as err:
            cli_main([command, *fit_args(resume_config, tmp_path / "a", f"--ckpt_path={step3}",
                                         f"--target.path={tuned}")[1:]])
        message = str(err.value)
        assert f"the checkpoint {step3} was made with other target weights than those of {tuned}" in message
        assert "--model.accept_target_change=true" in message and "\n" not in message
    assert not (tmp_path / "a" / "ckpt").exists()  # no step ran
    caplog.clear()
    cli, _, ckpts = fit(resume_config, tmp_path / "b", f"--ckpt_path={step3}", f"--target.path={tuned}",
                        "--model.accept_target_change=true", "--trainer.max_steps=4")
    assert cli.trainer.global_step == 4
    accepted = [r.getMessage() for r in caplog.records if "as model.accept_target_change says" in r.getMessage()]
    assert len(accepted) == 1 and str(step3) in accepted[0] and str(tuned) in accepted[0]
    assert "\n" not in accepted[0]
    cli, _, _ = fit(resume_config, tmp_path / "c", f"--ckpt_path={ckpts[4]}", f"--target.path={tuned}",
                    "--trainer.max_steps=5")  # the new checkpoint's fingerprint is the tuned target's
    assert cli.trainer.global_step == 5


def test_a_checkpoint_without_the_target_fingerprint_is_resumed_with_one_line(resume_config, step3, tmp_path,
                                                                              caplog):
    ckpt = torch.load(step3, weights_only=True)
    assert len(ckpt[RECORD_KEY][CONTENT]) == 64  # sha256 hex of the target's content
    del ckpt[RECORD_KEY][CONTENT]
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    cli, _, _ = fit(resume_config, tmp_path / "a", f"--ckpt_path={old}", "--trainer.max_steps=4")
    assert cli.trainer.global_step == 4
    lines = [r.getMessage() for r in caplog.records if "records no content fingerprint" in r.getMessage()]
    assert len(lines) == 1 and str(old) in lines[0]


def test_free_settings_take_effect_and_are_logged(resume_config, step3, tmp_path, caplog):
    """A typed lr (and max_steps) is the one used after the resume, never the checkpoint's, and the change is logged."""
    cli, losses, _ = fit(resume_config, tmp_path / "a", f"--ckpt_path={step3}", "--model.lr=0.001",
                         "--trainer.max_steps=5")
    assert cli.model.hparams.lr == 0.001 and cli.trainer.global_step == 5 and [s for s, _ in losses] == [3, 4]
    optimizer, scheduler = cli.trainer.optimizers[0], cli.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.base_lrs == [0.001, 0.001]
    assert [g["lr"] for g in optimizer.param_groups] == [0.001 * f(5) for f in scheduler.lr_lambdas]
    assert "model.lr: 0.003 -> 0.001" in caplog.text and "trainer.max_steps: 3 -> 5" in caplog.text


def test_the_compiled_drafter_loads_a_checkpoint_with_the_same_keys(resume_config, step3):
    """compile: true compiles the layers in place, so a resumed compiled run loads an eager checkpoint strictly.

    (A compiled resumed fit takes about 100 s on 2 shared CPU cores, too slow for the suite: see docs/long-runs.md.)
    """
    cli = cli_main(["--config", str(resume_config), "--model.compile=true"], run=False)
    cli.model.configure_model()
    state = torch.load(step3, weights_only=True)
    cli.model.load_state_dict(state["state_dict"], strict=True)
    assert list(cli.model.state_dict()) == list(state["state_dict"])
    assert state[RECORD_KEY]["model.compile"] is False  # a free setting: it may change on resume


# Layouts of a global batch of 2 packed rows. FSDP cannot run here: Lightning refuses `fsdp` without a GPU and
# torch 2.13's FSDP1 raises "FSDP needs a non-CPU accelerator device".
LAYOUTS = {
    "ddp x2": ["--trainer.strategy=ddp", "--trainer.devices=2"],
    "1 x acc2": ["--trainer.accumulate_grad_batches=2"],
    "ddp x1 acc2": ["--trainer.strategy=ddp", "--trainer.devices=1", "--trainer.accumulate_grad_batches=2"],
}


def fit_layout(config: Path, run: Path, layout: str, *args: str, code: int = 0) -> dict[int, Path]:
    """A run on `layout` that records every batch it trains; returns its checkpoints by step (`code`: the exit
    status a DDP run must end with).

    DDP runs as a user starts it, `python -m dflash_lightning fit` in a fresh process that starts the second rank
    itself: a rank forked from this test process could not run backward once an earlier test compiled anything
    (PyTorch's CUDA wheels then start autograd's device threads, GPU or not: see docs/versions.md).
    """
    run.mkdir(parents=True, exist_ok=True)
    record = "--trainer.callbacks+=" + json.dumps({"class_path": "helpers.RecordRows", "init_args": {"out": str(run)}})
    argv = fit_args(config, run, *LAYOUTS[layout], record, *args)
    if layout.startswith("ddp"):
        tests = Path(__file__).parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "dflash_lightning", *argv], cwd=tests.parent, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == code, done.stderr[-3000:]
    else:
        cli_main(argv)
    return results(run)[1]


def rows_by_step(run: Path) -> dict[int, list[tuple[int, int]]]:
    """Global step -> the (epoch, index in the epoch's global stream) of the rows trained in it, over all ranks."""
    where = {anchor_seed(0, "train", e, i): (e, i) for e in range(4) for i in range(32)}
    steps = defaultdict(list)
    for file in run.glob("rank*.txt"):
        for line in file.read_text().splitlines():
            epoch, seed, step = map(int, line.split())
            assert where[seed][0] == epoch
            steps[step].append(where[seed])
    return {step: sorted(rows) for step, rows in sorted(steps.items())}


@pytest.fixture(scope="module")
def across(resume_config, tmp_path_factory):
    """(before, after) -> (the uninterrupted run's folder on `before`, its checkpoints by step, the checkpoints of
    its resume from step 4 on `after`), each pair run once for the tests of this module."""
    runs: dict[tuple[str, str], tuple[Path, dict[int, Path], dict[int, Path]]] = {}

    def run(before: str, after: str):
        if (before, after) not in runs:
            root = tmp_path_factory.mktemp("across")
            ckpts = fit_layout(resume_config, root / "before", before)
            again = fit_layout(resume_config, root / "after", after, f"--ckpt_path={ckpts[4]}")
            runs[(before, after)] = root / "before", ckpts, again
        return runs[(before, after)]

    return run


ACROSS = [("ddp x2", "1 x acc2"), ("1 x acc2", "ddp x2")]


@pytest.mark.parametrize(("before", "after"), ACROSS)
def test_resume_on_another_number_of_ranks_trains_every_row_once(across, before, after):
    """Stopped after 4 steps of 2 rows (epoch 0 has 6 rows: step 4 is mid-epoch 1) and resumed on another layout
    of the same global batch: each step trains the rows the uninterrupted run trained in it, none twice or skipped.
    """
    run, _, again = across(before, after)
    uninterrupted = rows_by_step(run)
    assert len(uninterrupted) == 8 and all(len(rows) == 2 for rows in uninterrupted.values())
    assert [e for e, _ in uninterrupted[3]] == [1, 1] and [e for e, _ in uninterrupted[6]] == [2, 2]
    resumed = rows_by_step(run.with_name("after"))
    assert resumed == {step: rows for step, rows in uninterrupted.items() if step >= 4}
    assert max(again) == 8
    state = torch.load(again[8], weights_only=True)
    assert state["epoch"] == 2 and state["optimizer_states"][0]["state"]  # AdamW moments came along
    assert [s for s, _ in results(run.with_name("after"))[0]] == [4, 5, 6, 7]  # logged steps continue


@pytest.fixture(scope="module")
def preempt_config(resume_config) -> Path:
    """The resume config with the GPU configs' checkpoint settings: keep 2 by step, `last` a link, every 3 steps."""
    config = yaml.safe_load(resume_config.read_text())
    config["trainer"]["callbacks"][0]["init_args"] = {"filename": "{step}", "every_n_train_steps": 3, "save_top_k": 2,
                                                      "monitor": "step", "mode": "max", "save_last": "link"}
    path = resume_config.with_name("preempt.yaml")
    path.write_text(yaml.safe_dump(config))
    return path


SIGTERM_AT_3 = "--trainer.callbacks+=" + json.dumps(
    {"class_path": "test_faults.SendSignal", "init_args": {"signum": int(signal.SIGTERM), "at_step": 3}})
DDP_OF = {"ddp x2": "ddp x2", "1 x acc2": "ddp x1 acc2"}  # the same layout under DDP, whose preemption save is sharded


@pytest.mark.parametrize(("before", "after"), ACROSS)
def test_a_distributed_preemption_checkpoint_resumes_on_another_number_of_ranks(across, preempt_config, tmp_path,
                                                                                before, after):
    """SIGTERM in step 4 under DDP: every rank writes its share of a folder `step=4.ckpt/` that holds what the
    uninterrupted run's `step=4.ckpt` file holds, tensors bitwise. Resumed on the other layout (automatically from
    the newest of a file and a folder, or by --ckpt_path), it trains the rows of the uninterrupted run to the state,
    bitwise, of the resume from that file; the keep-K rotation then removes the folder like a file."""
    run, ckpts, again = across(before, after)
    ddp = DDP_OF[before]
    preempted = tmp_path / "preempted"
    fit_layout(preempt_config, preempted, ddp, SIGTERM_AT_3, code=143)
    folder = preempted / "ckpt" / "step=4.ckpt"
    assert folder.is_dir() and (preempted / "ckpt" / "last.ckpt").resolve() == folder
    shards = sorted(p.stat().st_size for p in folder.glob("*.distcp"))
    ranks = 2 if ddp == "ddp x2" else 1
    assert len(shards) == ranks and shards[0] > 0.4 * sum(shards) / ranks  # each rank wrote about its share
    assert distributed_record(folder)["ranks"] == ranks and distributed_record(folder)["write_s"] > 0
    state, file = load_checkpoint(folder), load_checkpoint(ckpts[4])
    assert state.keys() == file.keys()
    tensors = dict(_named_tensors({k: state[k] for k in ("state_dict", "optimizer_states")}))
    expected = dict(_named_tensors({k: file[k] for k in ("state_dict", "optimizer_states")}))
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[n], t) for n, t in expected.items())
    for key in ("loops", "lr_schedulers", "epoch", "global_step", "hyper_parameters", "drafter_config", "precision"):
        assert state[key] == file[key], key
    assert state[RECORD_KEY] == {**file[RECORD_KEY], "trainer.world_size": ranks,
                                 "trainer.accumulate_grad_batches": 2 // ranks}

    # the same command again, on the other layout: the same folder, the rows recorded after those of the first part
    by_path = [] if after == "1 x acc2" else [f"--ckpt_path={folder}"]  # else the automatic resume
    mine = fit_layout(preempt_config, preempted, after, *by_path)
    assert rows_by_step(preempted) == rows_by_step(run)  # every row once, in the step the uninterrupted run took it
    final, reference = (torch.load(p, weights_only=True) for p in (mine[8], again[8]))
    assert all(torch.equal(final["state_dict"][n], w) for n, w in reference["state_dict"].items())
    assert torch.equal(*(s["optimizer_states"][0]["state"][0]["exp_avg"] for s in (final, reference)))
    # K = 2 by step, and `last`; Lightning keeps the checkpoint a run was resumed from by --ckpt_path
    kept = ["last.ckpt", *(["step=4.ckpt"] if by_path else []), "step=6.ckpt", "step=8.ckpt"]
    assert sorted(p.name for p in (preempted / "ckpt").iterdir()) == kept


def test_a_resume_that_changes_the_global_batch_is_refused(resume_config, tmp_path):
    ckpts = fit_layout(resume_config, tmp_path / "before", "1 x acc2", "--trainer.max_steps=2")
    with pytest.raises(ResumeError, match=r"trainer\.global_batch: 2 -> 1 .*--trainer\.accumulate_grad_batches=2"):
        fit(resume_config, tmp_path / "after", f"--ckpt_path={ckpts[2]}")


def test_fields_unknown_now_are_not_compared():
    """Outside a Trainer the record has no trainer or data fields: they are neither refused nor reported."""
    saved = {"drafter.num_layers": 1, "trainer.global_batch": 8, "model.lr": 0.1}
    assert compare(saved, {"drafter.num_layers": 1, "model.lr": 0.2}) == ([], ["model.lr: 0.1 -> 0.2"])
    assert compare(saved, {"drafter.num_layers": 2})[0] == ["drafter.num_layers: 1 -> 2"]
    # a setting the lists do not name (one added later, say) is refused; validate checks the weights' fields only
    assert compare({"model.loss": "ce"}, {"model.loss": "kl"}) == (["model.loss: 'ce' -> 'kl'"], [])
    assert compare({"model.loss": "ce"}, {"model.loss": "kl"}, weights_only=True) == ([], ["model.loss: 'ce' -> 'kl'"])


def recording(out: Path) -> list[str]:
    """The callbacks that record each batch's rows and each optimizer step's weights into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    return [f"--trainer.callbacks+={json.dumps({'class_path': f'helpers.{cls}', 'init_args': {'out': str(out)}})}"
            for cls in ("RecordRows", "RecordWeights")]


def fit_process(config: Path, run: Path, out: Path, *args: str) -> int:
    """`python -m dflash_lightning fit` in a fresh process as a user starts it, recording each batch's rows and each
    optimizer step's weights into `out`; returns its exit status."""
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "dflash_lightning", *fit_args(config, run, *recording(out), *args)],
                          cwd=tests.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, -signal.SIGKILL), done.stderr[-3000:]
    return done.returncode


def steps_of(out: Path) -> tuple[dict[int, list[tuple[int, int]]], dict[int, str]]:
    """(step -> the rows trained in it, step -> digest of the weights after it) recorded by one process."""
    rows = rows_by_step(out)
    weights = dict(line.split() for line in (out / "weights.txt").read_text().splitlines())
    return rows, {int(step): digest for step, digest in weights.items()}


def kill_at(step: int) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": "helpers.KillAt", "init_args": {"at_step": step}})


SIGKILLS = "tests/test_resume.py::test_sigkills_between_saves_under_gradient_accumulation_resume_exactly"


@pytest.mark.parametrize("accumulate", [2, pytest.param(4, marks=pytest.mark.pinned_only(
    same_path_as=f"{SIGKILLS}[2]"))])  # the same calls into Lightning, 3 micro-batches lost instead of 1
def test_sigkills_between_saves_under_gradient_accumulation_resume_exactly(preempt_config, tmp_path, accumulate):
    """The GPU configs' checkpoints (every 3 steps, keep 2, `last` a link) under gradient accumulation, SIGKILLed
    inside step 5 (after the step-3 save), resumed by the same command, SIGKILLed inside step 6 (before the step-6
    save), resumed again: every step trains the rows of the uninterrupted run and ends with its weights, bitwise.
    Only optimizer-step boundaries are saved: a save after the resume's first micro-batch (Lightning's
    every_n_train_steps on the restored step 3) would hold step 4's first rows without their gradients."""
    acc = f"--trainer.accumulate_grad_batches={accumulate}"
    # the uninterrupted run in this process (one thread, as the killed ones): only the runs killed need their own
    cli_main(fit_args(preempt_config, tmp_path / "full", *recording(tmp_path / "full"), acc))
    full_rows, full_weights = steps_of(tmp_path / "full")
    assert sorted(full_weights) == list(range(1, 9)) and all(len(r) == accumulate for r in full_rows.values())

    run = tmp_path / "run"
    parts = [(kill_at(4), -signal.SIGKILL), (kill_at(5), -signal.SIGKILL), (None, 0)]
    rows: dict[int, list[tuple[int, int]]] = {}
    weights: dict[int, str] = {}
    for i, (kill, code) in enumerate(parts):
        assert fit_process(preempt_config, run, tmp_path / f"part{i}", acc, *([kill] if kill else [])) == code
        part_rows, part_weights = steps_of(tmp_path / f"part{i}")
        start = min(part_rows)  # where this part resumed: what earlier parts trained from there on is lost
        rows = {s: r for s, r in rows.items() if s < start} | part_rows
        weights = {s: w for s, w in weights.items() if s <= start} | part_weights
        if i:
            assert start == 3, i  # both kills fell between the saves of steps 3 and 6
    assert rows == full_rows
    assert weights == full_weights
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["last.ckpt", "step=6.ckpt", "step=8.ckpt"]


def test_a_checkpoint_saved_inside_a_gradient_accumulation_is_refused_or_skipped(resume_config, tmp_path, caplog,
                                                                                 monkeypatch):
    """An older version saved after the first micro-batch of a resumed run (Lightning's every_n_train_steps on the
    restored step): by --ckpt_path it is refused in one line naming it; the automatic resume skips it with a warning
    naming it and resumes from the newest checkpoint of an optimizer-step boundary."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dflash_lightning.long_runs.checkpointing import RunCheckpoint

    acc = "--trainer.accumulate_grad_batches=2"
    run = tmp_path / "run"
    boundary = fit(resume_config, run, acc, "--trainer.max_steps=3")[2][3]
    with monkeypatch.context() as m:  # the older version: no guard
        m.setattr(RunCheckpoint, "_should_skip_saving_checkpoint", ModelCheckpoint._should_skip_saving_checkpoint)
        cli_main(fit_args(resume_config, run, acc, f"--ckpt_path={boundary}", "--trainer.max_steps=4"))
    by_step = defaultdict(list)
    for path in (run / "ckpt").glob("*.ckpt"):
        by_step[load_checkpoint(path, mmap=True, verify=False)["global_step"]].append(path)
    (mid,) = [p for p in by_step[3] if p != boundary]
    for path in by_step[4]:  # killed before the next save
        path.unlink()
    with pytest.raises(ResumeError) as refused:
        fit(resume_config, tmp_path / "other", acc, f"--ckpt_path={mid}", "--trainer.max_steps=4")
    assert str(refused.value).startswith(f"cannot resume from {mid}: saved mid-way through a gradient accumulation "
                                         "(1 of 2 micro-batches of step 4 trained")
    assert "\n" not in str(refused.value)
    caplog.clear()
    cli = cli_main(fit_args(resume_config, run, acc, "--trainer.max_steps=4"))
    assert cli.trainer.global_step == 4
    assert f"skipping {mid}: saved mid-way through a gradient accumulation" in caplog.text
    assert f"resuming from {boundary}, the newest complete checkpoint" in caplog.text
