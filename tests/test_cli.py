"""The real CLI: fit and validate through LightningCLI on a tiny target, links, overrides, shipped YAMLs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from conftest import WORDS, make_target

from dflash_lightning.commands.cli import cli_main

CONFIGS = Path(__file__).parents[1] / "configs"


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            question = " ".join(rng.choices(WORDS, k=6)) + " ?"
            answer = " ".join(rng.choices(WORDS[:12], k=rng.randint(40, 80))) + " ."
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def small_config(root: Path, train_rows: int, val_rows: int = 0) -> dict:
    """configs/tiny.yaml on a 4-layer, 32-wide target and written conversations: 256-token rows, 16 anchors, B = 8."""
    config = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    config["target"]["path"] = str(make_target(root / "target", layers=4, hidden=32, heads=2, kv_heads=1))
    val = [str(write_conversations(root / "val.jsonl", val_rows, seed=1))] if val_rows else None
    config["data"] = dict(train_files=[str(write_conversations(root / "train.jsonl", train_rows))], val_files=val,
                          token_budget=256, max_documents=8)
    config["model"].update(num_anchors=16)
    config["model"]["drafter"].update(num_layers=1, block_size=8)
    return config


def four_step_config(root: Path) -> dict:
    """The small config for a 4-step fit (validation every 2) whose logs and checkpoints go under `root/runs`."""
    config = small_config(root, 40, 8)
    config["trainer"].update(default_root_dir=str(root / "runs"), max_steps=4, val_check_interval=2,
                             limit_val_batches=2, log_every_n_steps=1)
    for logger in config["trainer"]["logger"]:
        logger["init_args"]["save_dir"] = str(root / "runs")
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"]["dirpath"] = str(root / "runs" / "checkpoints")
    return config


@pytest.fixture(scope="module")
def run_config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    config = four_step_config(root)
    config.setdefault("spec_eval", {})["prompts"] = None
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_fit_runs_through_the_cli_and_logs(run_config):
    prompts = run_config.parent / "val.jsonl"
    cli = cli_main(["fit", "--config", str(run_config), "--model.metrics_every=2", f"--spec_eval.prompts={prompts}",
                    "--spec_eval.every_n_steps=2", "--spec_eval.num_prompts=2", "--spec_eval.max_new_tokens=8"])
    trainer, module = cli.trainer, cli.model
    assert trainer.global_step == 4
    # Linked once, used everywhere.
    assert module.hparams.target == cli.datamodule.hparams.tokenizer == cli.config_init.fit.target.path
    assert module.hparams.token_budget == cli.datamodule.hparams.token_budget == 256
    assert cli.datamodule.hparams.block_size == module.drafter_config.block_size == 8
    logged = trainer.logged_metrics
    for key in ("train/loss", "train/acc", "train/tau", "train/top5", "val/loss", "val/tau", "val/tau_served",
                "val/tau_served_prompt_mean"):
        assert key in logged, key
    assert logged["val/speculative_mismatches"] == 0  # served decoding is lossless
    metrics_csv = next(Path(trainer.default_root_dir).rglob("metrics.csv"))
    assert "train/acc/slot_01" in metrics_csv.read_text().splitlines()[0]
    events = next(Path(trainer.default_root_dir).rglob("events.out.tfevents.*"))
    assert events.parent == metrics_csv.parent  # one version_N per run for both loggers
    ckpt = next(Path(trainer.default_root_dir).rglob("*.ckpt"))
    assert ckpt.exists()


def test_no_progress_bar_leaves_out_the_configs_bar(run_config):
    """`--trainer.enable_progress_bar=false` (a cluster's log) on a config naming RichProgressBar trains, barless."""
    assert "RichProgressBar" in run_config.read_text()
    cli = cli_main(["fit", "--config", str(run_config), "--trainer.enable_progress_bar=false",
                    "--trainer.max_steps=1", "--preemption.resume=never"])
    assert cli.trainer.global_step == 1 and cli.trainer.progress_bar_callback is None
    assert not any("ProgressBar" in type(c).__name__ for c in cli.trainer.callbacks)


def test_validate_from_checkpoint(run_config):
    """`validate --ckpt_path` validates the checkpoint's weights: the module holds them, and its val/loss is not the
    freshly built drafter's."""
    import torch

    cli_main(["fit", "--config", str(run_config), "--trainer.max_steps=2"])
    ckpt = sorted(run_config.parent.rglob("*.ckpt"))[-1]
    cli = cli_main(["validate", "--config", str(run_config), "--ckpt_path", str(ckpt)])
    saved, held = torch.load(ckpt, weights_only=True)["state_dict"], cli.model.state_dict()
    assert saved.keys() == held.keys() and all(torch.equal(saved[k], held[k]) for k in saved)
    fresh = cli_main(["validate", "--config", str(run_config)])
    assert fresh.trainer.callback_metrics["val/loss"] != cli.trainer.callback_metrics["val/loss"]


def test_print_config_shows_linked_sections(run_config, capsys):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(run_config), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["target"]["path"] and printed["model"]["drafter"]["block_size"] == 8


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_parses_and_instantiates(name, tmp_path):
    """Real targets cannot be downloaded here: each config runs against a tiny stand-in of its kind."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    stand_in = make_target(tmp_path / "target", layers=8, hidden=32, heads=2, kv_heads=1)
    data = write_conversations(tmp_path / "d.jsonl", 4)
    args = ["--config", str(CONFIGS / name), f"--target.path={stand_in}",
            f"--data.train_files=[{data}]", f"--data.val_files=[{data}]", "--trainer.accelerator=cpu",
            "--trainer.devices=1", "--trainer.precision=32-true", "--model.compile=false"]
    cli = cli_main(args, run=False)
    assert cli.model.drafter_config.block_size == config["model"]["drafter"]["block_size"]
    assert cli.model.drafter_config.num_layers == config["model"]["drafter"]["num_layers"]
    assert cli.datamodule.hparams.block_size == cli.model.drafter_config.block_size


def test_separate_target_placement_gives_the_same_run(run_config):
    """Features computed ahead by a target in its own thread/device give the same losses as co-located."""
    losses = {}
    for placement in ("colocated", "separate"):
        extra = ["--target.target_devices=[cpu]", "--target.prefetch=2"] if placement == "separate" else []
        cli = cli_main(["fit", "--config", str(run_config), "--model.metrics_every=1", "--trainer.max_steps=3",
                        "--preemption.resume=never", f"--target.placement={placement}", *extra])
        losses[placement] = (float(cli.trainer.logged_metrics["train/loss"]),
                             float(cli.trainer.logged_metrics["val/loss"]))
    assert losses["colocated"] == pytest.approx(losses["separate"], rel=1e-6)


BAD_VALUE = pytest.mark.pinned_only(  # the parse is the first value's; the checks are ours
    same_path_as="tests/test_cli.py::test_bad_model_values_are_refused_naming_the_field"
                 "[--model.head_chunk_size=0-head_chunk_size must be >= 1, got 0]")


@pytest.mark.parametrize(("option", "message"), [
    ("--model.head_chunk_size=0", "head_chunk_size must be >= 1, got 0"),
    pytest.param("--model.warmup_ratio=2", r"warmup_ratio must be in \[0, 1\).*got 2", marks=BAD_VALUE),
    pytest.param("--model.warmup_ratio=1.0", r"warmup_ratio must be in \[0, 1\).*got 1.0", marks=BAD_VALUE),
    pytest.param("--model.warmup_ratio=-0.1", r"warmup_ratio must be in \[0, 1\).*got -0.1", marks=BAD_VALUE),
])
def test_bad_model_values_are_refused_naming_the_field(run_config, option, message):
    from dflash_lightning.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        cli_main(["--config", str(run_config), option], run=False)


@pytest.mark.parametrize("option", ["--model.num_anchor=8", "--model.drafter.num_layer=2", "--trainer.max_step=3"])
def test_option_prefixes_are_not_taken_for_whole_names(run_config, option, capsys):
    """argparse would take `--model.num_anchor` for `--model.num_anchors`; a typo must not set another field."""
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(run_config), option])
    assert f"unrecognized arguments: {option}" in capsys.readouterr().err


def test_a_target_under_the_home_folder_reaches_every_linked_setting_expanded(run_config, monkeypatch, tmp_path):
    """configs/smollm2-135m.yaml names its target `~/.cache/...`: the tokenizer, the module, spec_eval and the data
    get the folder spelled out (the tokenizer loader would take `~/...` for a hub id)."""
    import shutil

    config = yaml.safe_load(run_config.read_text())
    shutil.copytree(config["target"]["path"], tmp_path / "home" / "target")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cli = cli_main(["--config", str(run_config), "--target.path=~/target"], run=False)
    want = str(tmp_path / "home" / "target")
    spec_eval = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SpeculativeValidation")
    assert cli.model.hparams.target == cli.datamodule.hparams.tokenizer == spec_eval.target == want
