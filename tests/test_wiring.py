"""DFlashModule, DFlashDataModule and TargetFeatures get their shared values in their constructors: a notebook builds
the same objects as the CLI without a Trainer, and values given by hand that disagree are refused naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_lightning.commands.fit import main
from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.data import DFlashDataModule
from dflash_lightning.module import DFlashModule
from dflash_lightning.target_model import TargetFeatures
from dflash_lightning.target_model.wiring import check_wiring

TARGET = "dflash_lightning/assets/tiny/target_model"
TRAIN = "dflash_lightning/assets/tiny/data/train.jsonl"
ROOT = Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the paths above and the config's are relative to it


def by_hand(objective: str = "kl", cache: str | None = None, **data_overrides):
    """The three objects a notebook builds, from the module's values (what the CLI links)."""
    module = DFlashModule(TARGET, DrafterConfig(num_layers=1, block_size=8), token_budget=256, num_anchors=8,
                          objective=objective)
    ids, distills = module.drafter_config.target_layer_ids, module.loss_settings.distills
    data = DFlashDataModule([TRAIN], tokenizer=TARGET, token_budget=256, block_size=8, feature_cache=cache,
                            target=TARGET, target_layer_ids=ids, final_hidden=distills, **data_overrides)
    target = TargetFeatures(TARGET, "float32", layer_ids=ids, final_hidden=distills, token_budget=256,
                            feature_cache=cache)
    return module, data, target


@pytest.mark.parametrize("objective", ["ce", "kl"])
def test_built_in_plain_python_as_the_cli_builds_them(objective):
    module, data, target = by_hand(objective)
    check_wiring(module, data, target)
    cli = main(["--config", "configs/tiny.yaml", "--trainer.logger=false", "--trainer.callbacks=[]",
                "--model.drafter.variant=dflash", "--model.drafter.num_layers=1", "--model.drafter.block_size=8",
                "--data.token_budget=256", "--model.num_anchors=8", f"--model.objective={objective}",
                f"--data.train_files=[{TRAIN}]"], run=False)
    linked = next(c for c in cli.trainer.callbacks if isinstance(c, TargetFeatures))
    check_wiring(cli.model, cli.datamodule, linked)
    for name in ("layer_ids", "final_hidden", "token_budget", "feature_cache", "path"):
        assert getattr(linked, name) == getattr(target, name), name
    for name in ("target", "target_layer_ids", "final_hidden", "token_budget"):
        assert getattr(cli.datamodule, name) == getattr(data, name), name
    # the drafter's values are the model's settings in a checkpoint's record, not again data settings
    assert not {"target", "target_layer_ids", "final_hidden"} & set(cli.datamodule.hparams)


@pytest.mark.parametrize(("change", "message"), [
    (lambda m, d, t: setattr(t, "layer_ids", [0]),
     r"target\.layer_ids \[0\] differs from model\.drafter\.target_layer_ids \[3\]"),
    (lambda m, d, t: setattr(t, "final_hidden", False),
     r"target\.final_hidden False differs from model\.objective \(kl: distills True\) True"),
    (lambda m, d, t: setattr(t, "token_budget", 512), r"target\.token_budget 512 differs from data\.token_budget 256"),
    (lambda m, d, t: setattr(t, "path", "elsewhere"), r"target\.path 'elsewhere' differs from model\.target '.*'"),
    (lambda m, d, t: setattr(d, "token_budget", 512), r"data\.token_budget 512 differs from model\.token_budget 256"),
    (lambda m, d, t: d.hparams.update(block_size=4), r"data\.block_size 4 differs from model\.drafter\.block_size 8"),
    (lambda m, d, t: d.hparams.update(feature_cache="cache"),
     r"target\.feature_cache None differs from data\.feature_cache 'cache'"),
])
def test_inconsistent_values_given_by_hand_are_refused_naming_both(change, message):
    module, data, target = by_hand("kl")
    change(module, data, target)
    with pytest.raises(ConfigError, match=message) as err:
        check_wiring(module, data, target)
    assert "\n" not in str(err.value)


def test_with_a_feature_cache_the_data_module_must_carry_the_drafters_layers():
    module, data, target = by_hand("kl", cache="cache")
    check_wiring(module, data, target)
    data.target_layer_ids = [0]
    with pytest.raises(ConfigError, match=r"^data\.target_layer_ids \[0\] differs from model\.drafter\.target_"):
        check_wiring(module, data)
    with pytest.raises(ConfigError, match=r"^target\.fp8: data\.feature_cache cache serves stored features"):
        TargetFeatures(TARGET, feature_cache="cache", fp8=True)


def test_a_target_without_layer_ids_is_refused_at_setup():
    from types import SimpleNamespace

    import torch

    trainer = SimpleNamespace(datamodule=None, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with pytest.raises(ConfigError, match=r"^target\.layer_ids: not given"):
        TargetFeatures(TARGET, "float32").setup(trainer, object(), "fit")
