"""The README's first command prints what a user needs and no noise: no Lightning warning that tells nothing, no
`Epoch 6/-2`, no `Total FLOPs: 0`; a warning that says something still comes through."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import yaml

from dflash_lightning.commands.console import HARMLESS, quiet_lightning

ROOT = Path(__file__).parents[1]
WARNING_LINE = re.compile(r"\.py:\d+: |Warning|warn", re.IGNORECASE)  # how Python and Lightning print a warning


def test_the_first_command_prints_no_noise(tmp_path):
    """configs/tiny.yaml as the README runs it (3 steps, one validation with served tau), into a fresh folder."""
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    run = tmp_path / "runs"
    config["trainer"].update(max_steps=3, val_check_interval=2, limit_val_batches=1, default_root_dir=str(run))
    for logger in config["trainer"]["logger"]:
        logger["init_args"]["save_dir"] = str(run)
    config["trainer"]["callbacks"][-1]["init_args"]["dirpath"] = str(run / "checkpoints")
    config["spec_eval"].update(every_n_steps=2, num_prompts=1, max_new_tokens=8)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "dflash_lightning", "fit", "--config", str(path)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160"}, capture_output=True,
                          text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    noise = [line for line in out.splitlines() if WARNING_LINE.search(line) or "Tip:" in line or "FLOPs" in line
             or "Loading weights" in line]  # transformers 5.x's bar, drawn per from_pretrained
    assert not noise, "\n".join(noise)
    assert "Epoch 0/0" in done.stdout and "/-" not in done.stdout  # max_steps=3 ends in the first epoch
    assert "Total params" in done.stdout  # the summary is still there


def test_only_the_harmless_warnings_are_silenced():
    """Each silenced message by its start; any other warning, Lightning's own included, still comes through."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("Your `IterableDataset` has `__len__` defined. In combination with ...", UserWarning,
                      stacklevel=1)
        warnings.warn("The dataloader does not have many workers which may be a bottleneck.", UserWarning,
                      stacklevel=1)
    assert [str(w.message)[:30] for w in caught] == ["The dataloader does not have m"]
    assert len(HARMLESS) == 2


def test_the_progress_bar_counts_epochs_to_the_end_max_steps_sets():
    """400 steps of 60 batches end in epoch 6: `Epoch 6/6` where Lightning's bar read `Epoch 6/-2`."""
    from types import SimpleNamespace

    from dflash_lightning.commands.console import RunProgressBar

    bar = RunProgressBar()

    def described(epoch: int, **trainer) -> str:
        bar._trainer = SimpleNamespace(**{"max_epochs": -1, "max_steps": 400, "num_training_batches": 60,
                                          "accumulate_grad_batches": 1} | trainer)
        return bar._get_train_description(epoch).strip()

    assert described(6) == "Epoch 6/6"
    assert described(0, accumulate_grad_batches=2) == "Epoch 0/13"  # 800 batches
    assert described(1, max_epochs=3) == "Epoch 1/2"  # max_epochs ends it first
    assert described(2, max_steps=-1, max_epochs=5) == "Epoch 2/4"  # Lightning's own
    assert described(3, num_training_batches=float("inf")) == "Epoch 3"  # no length: no end to show


def test_the_suite_filters_warnings_by_message_so_a_new_one_shows():
    """pyproject.toml's filters each name a message (never a whole class, which would hide a new warning of torch or
    Lightning), and they take effect: the README's test command keeps pytest's warnings plugin."""
    import tomllib

    from _pytest.warnings import parse_warning_filter

    filters = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    for entry in filters:
        action, message, *_ = parse_warning_filter(entry, escape=False)
        assert action == "ignore" and message, f"{entry!r}: a filter names the message it ignores"
    command = next(line for line in (ROOT / "README.md").read_text().splitlines() if "python -m pytest" in line)
    assert "no:warnings" not in command, command
