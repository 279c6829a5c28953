"""The folder codec alone (dflash_lightning/folder/codec.py): a DrafterConfig and its weights to config.json's fields
and the tensors by name, and back, for every preset, with no file opened (torchtitan tests its state-dict adapters so).
"""

from __future__ import annotations

import builtins
import io
import json
import os
from pathlib import Path

import pytest
import torch
from test_contract import VARIANTS, tiny_config

from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.folder.codec import folder_tensors, from_folder, hf_config, served_dtype
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.target_model import load_target_config, tokenizer_ids

TINY_TARGET = Path(__file__).parents[1] / "dflash_lightning" / "assets" / "tiny" / "target_model"


@pytest.fixture(scope="module")
def drafters() -> dict[str, tuple[DrafterConfig, dict[str, torch.Tensor]]]:
    """Every preset's config for the tiny default target, with its drafter's initial weights."""
    target, ids = load_target_config(str(TINY_TARGET)), tokenizer_ids(str(TINY_TARGET))
    made = {}
    for variant in VARIANTS:
        cfg = tiny_config(variant).resolved(target, *ids)
        made[variant] = cfg, DFlashDrafter(cfg).state_dict()
    return made


@pytest.fixture
def no_files(monkeypatch):
    """A file opened by the code under test fails it: the codec maps values, reading and writing are elsewhere."""
    def refuse(path, *args, **kwargs):
        raise AssertionError(f"the codec opened {path}")

    for module in (builtins, io, os):
        monkeypatch.setattr(module, "open", refuse)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_preset_round_trips_through_config_json_and_tensor_names(drafters, no_files, dtype):
    for variant, (cfg, state) in drafters.items():
        raw = json.loads(json.dumps(hf_config(cfg, dtype)))  # as a file would hold it
        for part in cfg.preset.parts:  # each part's fields through its own hooks, where the engines read them
            settings = getattr(cfg, part.name)
            assert part.export_fields(settings, cfg).items() <= raw["dflash_config"].items(), variant
            assert part.top_level_fields(settings, cfg).items() <= raw.items(), variant
        tensors, saved = folder_tensors(state, dtype, "test")
        assert saved == dtype == raw["dtype"]
        back, weights = from_folder(raw, tensors, "test")
        training = set(cfg.training_fields())  # choices a folder does not carry
        assert {k: v for k, v in back.flat_dict().items() if k not in training} == {
            k: v for k, v in cfg.flat_dict().items() if k not in training}, variant
        assert list(weights) == list(state) and all(torch.equal(weights[k], tensors[k]) for k in state)


def test_the_codec_names_what_does_not_fit(drafters, no_files):
    cfg, state = drafters["dflash2"]
    raw = hf_config(cfg, "float32")
    name = next(iter(state))
    with pytest.raises(ValueError, match=f"test: weights do not match the drafter config: missing '{name}'"):
        from_folder(raw, {k: v for k, v in state.items() if k != name}, "test")
    with pytest.raises(ValueError, match="unexpected 'extra.weight'"):
        from_folder(raw, {**state, "extra.weight": torch.zeros(1)}, "test")
    with pytest.raises(ConfigError, match="lacks required field\\(s\\): block_size"):
        from_folder({k: v for k, v in raw.items() if k != "block_size"}, state, "test")
    part = next(part for part in cfg.preset.parts if part.config_fields)
    key = next(iter(part.config_fields))
    lacking = {**raw, "dflash_config": {k: v for k, v in raw["dflash_config"].items() if k != key}}
    with pytest.raises(ConfigError, match=f"lacks dflash_config.{key}"):
        from_folder(lacking, state, "test")
    plain, plain_state = drafters["dflash"]  # a DFlashDraftModel holding dflash2's part fields
    foreign = hf_config(plain, "float32")
    foreign["dflash_config"] = raw["dflash_config"]
    with pytest.raises(ConfigError, match="a DFlashDraftModel has field\\(s\\) dflash_config.conv_kernel_size"):
        from_folder(foreign, plain_state, "test")


def test_a_cast_that_overflows_or_a_mix_of_dtypes_is_refused_by_weight_name(no_files):
    with pytest.raises(ValueError, match="'big' holds values up to 1e\\+06, past the range of float16"):
        folder_tensors({"small": torch.ones(2), "big": torch.tensor([1e6])}, "float16", "test")
    with pytest.raises(ValueError, match="test: weights of dtype\\(s\\) \\['bfloat16', 'float32'\\]"):
        folder_tensors({"a": torch.ones(2), "b": torch.ones(2, dtype=torch.bfloat16)}, None, "test")


def test_the_served_dtype_is_asked_else_required_else_trained(drafters, no_files):
    cfg = drafters["dflash"][0]
    assert served_dtype(cfg, None, "bf16-mixed") == "bfloat16"
    assert served_dtype(cfg, "float16", "bf16-mixed") == "float16"
    assert served_dtype(cfg, None, None) is None  # as stored
    required = next(v for v, (c, _) in drafters.items() if any(p.folder_dtype for p in c.preset.parts))
    need = next(p.folder_dtype for p in drafters[required][0].preset.parts if p.folder_dtype)
    assert served_dtype(drafters[required][0], None, "32-true") == need
    with pytest.raises(ConfigError, match=f"is served only in {need}"):
        served_dtype(drafters[required][0], "float32", None)
