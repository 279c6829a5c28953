"""The command line's failures as a user meets them: one `error:` line, exit 2 for a bad setting, no noise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_faults import assets, fault_config, fit, good_checkpoints  # noqa: F401 (fixtures)

from dflash_lightning.commands.cli import cli_main
from dflash_lightning.config import ConfigError
from dflash_lightning.long_runs.checkpointing import CheckpointError
from dflash_lightning.long_runs.resume import RECORD_KEY, ResumeError

ROOT = Path(__file__).parents[1]
NOISE = ("Traceback", "torchao", "LightningCLI's args parameter")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_lightning", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300)


@pytest.mark.parametrize(("value", "message"), [
    pytest.param("inf", "'inf' is not finite", marks=pytest.mark.pinned_only(
        same_path_as="tests/test_errors.py::test_bad_temperature_is_one_line_and_exit_2[-1-must be >= 0]")),
    ("-1", "must be >= 0")])
def test_bad_temperature_is_one_line_and_exit_2(tmp_path, value, message):
    out = run("evaluate", "--drafter", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl"), "--temperature", value)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: temperature"), out.stderr[-2000:]
    assert message in lines[0] and not any(n in out.stderr for n in NOISE)


def test_the_traceback_comes_only_when_asked(tmp_path):
    out = run("evaluate", "--drafter", str(tmp_path), "--prompts", "p", "--temperature", "inf",
              env={"DFLASH_TRACEBACK": "1"})
    assert out.returncode == 1 and "Traceback" in out.stderr and "is not finite" in out.stderr


def test_fit_refuses_a_bad_setting_in_one_line_without_the_lightningcli_warning(assets, tmp_path):  # noqa: F811
    config = fault_config(assets, tmp_path)
    out = run("fit", "--config", str(config), "--model.fp8=all")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: model.fp8")
    assert not any(n in out.stderr for n in NOISE), out.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a GPU run needs a machine without one")
def test_a_trainer_setting_lightning_refuses_is_one_line_and_exit_2(assets, tmp_path):  # noqa: F811
    """A GPU config on a CPU machine: Lightning's MisconfigurationException, as a bad setting, not a traceback."""
    out = run("fit", "--config", str(fault_config(assets, tmp_path)), "--trainer.accelerator=gpu")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-2000:]
    assert lines[-1].startswith("error: trainer settings (Lightning): ") and "gpu" in lines[-1].lower(), lines[-1]
    assert not any(n in out.stderr for n in NOISE), out.stderr[-2000:]


GPU_CONFIG = str(ROOT / "configs" / "qwen3-8b.yaml")  # its target, Qwen/Qwen3-8B, is a hub id
ON_CPU = ("--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true")


def no_hub(tmp_path: Path, offline: bool) -> dict[str, str]:
    """An empty Hugging Face cache and either HF_HUB_OFFLINE=1 or a hub that cannot be reached (a closed port)."""
    cache = str(tmp_path / "hf" / "hub")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": cache, "HUGGINGFACE_HUB_CACHE": cache,
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    return env | {"HF_HUB_OFFLINE": "1"} if offline else env


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a GPU run needs a machine without one")
@pytest.mark.pinned_only(same_path_as="tests/test_errors.py::test_a_trainer_setting_lightning_refuses_is_one_line_and_exit_2")
def test_a_gpu_config_on_a_cpu_machine_is_refused_before_the_target_is_looked_up(tmp_path):
    out = run("fit", "--config", GPU_CONFIG, env=no_hub(tmp_path, offline=False))
    lines = [line for line in out.stderr.strip().splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: trainer settings (Lightning): trainer.accelerator=gpu: this machine has no "
                               "GPU (available: cpu); run on a machine that has one"), lines[0]
    assert "Qwen3-8B" not in out.stderr and not any(n in out.stderr for n in NOISE), out.stderr[-2000:]


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE=1", "unreachable"])
def test_a_target_that_cannot_be_found_is_one_line_naming_it_and_the_setting(tmp_path, offline):
    out = run("fit", "--config", GPU_CONFIG, *ON_CPU, env=no_hub(tmp_path, offline))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1].startswith("error: target.path: cannot get the model 'Qwen/Qwen3-8B': "
                                                        "not in the Hugging Face cache and "), out.stderr[-2000:]
    why = "HF_HUB_OFFLINE=1 forbids a download" if offline else "the hub cannot be reached (ConnectError: "
    assert why in lines[-1] and "download it where the hub can be reached (`hf download Qwen/Qwen3-8B`), or set "\
        "target.path to a local model folder" in lines[-1]
    assert [line for line in lines if line != "Seed set to 0"] == lines[-1:], out.stderr[-2000:]  # nothing else


@pytest.mark.pinned_only(  # the check of target.path is ours
    same_path_as="tests/test_errors.py::test_fit_refuses_a_bad_setting_in_one_line_without_the_lightningcli_warning")
def test_a_target_folder_that_does_not_exist_is_one_line_naming_the_setting(assets, tmp_path):  # noqa: F811
    out = run("fit", "--config", str(fault_config(assets, tmp_path)), f"--target.path={tmp_path / 'missing'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"error: target.path: no model folder at '{tmp_path / 'missing'}' (nor a hub id, 'org/name'): set "
        "target.path to a local Hugging Face model folder or a hub id"), out.stderr[-2000:]


def test_an_unwritable_checkpoint_folder_is_refused_before_the_first_step(assets, tmp_path):  # noqa: F811
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = fault_config(assets, tmp_path / "run", checkpoints=blocker / "checkpoints")
    with pytest.raises(CheckpointError, match="checkpoint folder is not writable") as err:
        fit(config)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "steps").exists()


def test_a_killed_saves_leftover_is_removed_by_a_start_with_ckpt_path(good_checkpoints, tmp_path):  # noqa: F811
    folder = good_checkpoints / "checkpoints"
    leftover = folder / ".last.ckpt.999999.partial"
    leftover.write_bytes(b"\0" * 4096)
    cli = fit(good_checkpoints / "input.yaml", f"--ckpt_path={folder / 'step=2.ckpt'}", "--trainer.max_steps=3")
    assert cli.trainer.global_step == 3 and not leftover.exists()


@pytest.mark.pinned_only(  # an export in a process of its own, as there; the range check is ours
    same_path_as="tests/test_faults.py::test_damaged_checkpoint_is_refused_in_one_line_by_export_evaluate_and_fit"
                 "[truncated]")
def test_export_to_float16_of_values_past_its_range_is_refused_naming_the_tensor(good_checkpoints, tmp_path):  # noqa: F811
    ckpt = torch.load(good_checkpoints / "checkpoints" / "step=4.ckpt", weights_only=True)
    ckpt["state_dict"]["drafter.fc.weight"] *= 1e9  # an edit on purpose: its checksums go with it
    del ckpt["dflash_checksums"]
    torch.save(ckpt, tmp_path / "big.ckpt")
    out = run("export", "--checkpoint", str(tmp_path / "big.ckpt"), "--out", str(tmp_path / "hf"), "--dtype", "float16")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and not any(n in out.stderr for n in NOISE), out.stderr[-2000:]
    assert lines[0].startswith("error: export: 'fc.weight' holds values up to ")
    assert "past the range of float16" in lines[0]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("setting", "message"), [
    (["--model.drafter.layer_types=[full_attention,bogus]", "--model.drafter.num_layers=2"],
     "layer_types: unknown type(s) ['bogus']; use full_attention or sliding_attention"),
    (["--model.drafter.layer_types=[full_attention,full_attention]"],
     "layer_types has 2 entries, the drafter has num_layers=1"),
    (["--model.drafter.layer_types=[sliding_attention]", "--model.drafter.sliding_window=0"],
     "sliding_window must be >= 1 for sliding_attention layers, got 0"),
    (["--model.drafter.layer_types=[sliding_attention]", "--model.drafter.sliding_window=-4"],
     "sliding_window must be >= 1 for sliding_attention layers, got -4"),
    (["--model.drafter.layer_types=[sliding_attention]"],
     "sliding_window must be >= 1 for sliding_attention layers, got None"),
    (["--model.drafter.sliding_window=64"], "sliding_window (64) is set but no layer is sliding_attention"),
])
def test_bad_attention_layout_is_one_line_before_any_target_work(assets, tmp_path, setting, message, monkeypatch):  # noqa: F811
    import dflash_lightning.module as module

    monkeypatch.setattr(module, "load_target_io", lambda *a: pytest.fail("the target was loaded"))
    with pytest.raises(ConfigError) as err:
        cli_main(["--config", str(fault_config(assets, tmp_path)), *setting], run=False)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_checkpoint_of_another_drafter_is_one_line_naming_the_fields(good_checkpoints, tmp_path):  # noqa: F811
    """Given to fit --ckpt_path or validate, with its settings record or without one (an older version): the fields
    that differ, not Lightning's 'Missing key(s) in state_dict' traceback."""
    step4 = good_checkpoints / "checkpoints" / "step=4.ckpt"
    ckpt = torch.load(step4, weights_only=True)
    del ckpt[RECORD_KEY]
    torch.save(ckpt, tmp_path / "old.ckpt")
    other = ["--model.drafter.num_layers=2", f"--trainer.default_root_dir={tmp_path / 'run'}",
             f"--trainer.callbacks.dirpath={tmp_path / 'run'}"]
    config = str(good_checkpoints / "input.yaml")
    for command, path, message in (
            ("fit", step4, f"cannot resume from {step4}: these settings change what is trained (checkpoint -> now): "
                           "drafter.num_layers: 1 -> 2; drafter.target_layer_ids: [2] -> [1, 1]."),
            ("validate", tmp_path / "old.ckpt",
             f"the checkpoint {tmp_path / 'old.ckpt'} holds other weights than this run's drafter: drafter fields "
             "differ (checkpoint -> now): drafter.num_layers: 1 -> 2; drafter.target_layer_ids: [2] -> [1, 1]; "
             "weights: 11 missing (drafter.layers.1.")):
        with pytest.raises(ResumeError) as err:
            cli_main([command, "--config", config, f"--ckpt_path={path}", *other])
        assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value
    out = run("validate", "--config", config, f"--ckpt_path={tmp_path / 'old.ckpt'}", *other)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: the checkpoint {tmp_path / 'old.ckpt'} holds")
