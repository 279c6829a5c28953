"""The command line's failures as a user meets them: one `error:` line, exit 2 for a bad setting, no noise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import assets, fault_config, fit, good_checkpoints  # noqa: F401 (fixtures)

from dflash_lightning.long_runs.checkpointing import CheckpointError

ROOT = Path(__file__).parents[1]
NOISE = ("Traceback", "torchao", "LightningCLI's args parameter")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_lightning", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300)


@pytest.mark.parametrize(("value", "message"), [("inf", "'inf' is not finite"), ("-1", "must be >= 0")])
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
