"""Variants as presets of parts: the preset table is the only place a variant is named; checkpoints written before
the parts had their own settings (flat `conv_kernel_size` ... fields) still resume, warm-start and export."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from test_resume import fit, resume_config, step3  # noqa: F401 (fixtures)

import dflash_lightning
from dflash_lightning.config import LEGACY_FIELDS, LEGACY_RECORD, ConfigError, DrafterConfig
from dflash_lightning.folder.reader import read_checkpoint
from dflash_lightning.folder.writer import export_checkpoint
from dflash_lightning.long_runs.resume import RECORD_KEY
from dflash_lightning.parts.presets import ALL_PARTS, PRESETS, preset

PACKAGE = Path(dflash_lightning.__file__).parent


def test_no_code_outside_the_preset_table_names_a_variant():
    """A variant's name appears as a string only in parts/presets.py (docstrings and comments aside); a name that is
    also a part's (`lilicorr`: its settings field and weight prefix; `dspark`: its heads' metric prefix) only where it
    is never compared."""
    part_names = {n for part in ALL_PARTS for n in (part.name, part.weight_prefix, part.prefix())}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "presets.py" or "hf" in path.parts:  # the served modelling file stands alone
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        compared = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                    for c in ast.walk(node) if isinstance(c, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in PRESETS and id(node) not in docstrings:
                if node.value not in part_names or id(node) in compared:
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


def test_unknown_variant_is_refused_naming_the_presets():
    with pytest.raises(ConfigError, match="variant: unknown drafter variant 'dflash3'; use dflash or dflash2 or "
                                          "lilicorr or lilicorr-conv or dspark or domino or xpress"):
        preset("dflash3")


def legacy(ckpt: dict) -> dict:
    """A checkpoint as the version before parts wrote it: flat part fields, the selector's weight a module argument."""
    cfg = ckpt["drafter_config"]
    for old, (part, name) in LEGACY_FIELDS.items():
        cfg[old] = cfg[part][name]
    alpha = cfg["selector"]["loss_weight"]
    del cfg["conv"], cfg["selector"]
    back = {new: old for old, new in LEGACY_RECORD.items()}
    ckpt[RECORD_KEY] = {back.get(k, k): v for k, v in ckpt[RECORD_KEY].items() if k != "drafter.selector.loss_weight"}
    ckpt[RECORD_KEY]["model.selector_alpha"] = alpha
    ckpt["hyper_parameters"]["selector_alpha"] = alpha
    return ckpt


def test_a_checkpoint_of_the_flat_fields_resumes_exports_and_warm_starts(resume_config, step3, tmp_path, caplog):  # noqa: F811
    ckpt = torch.load(step3, weights_only=True)
    assert ckpt["drafter_config"]["variant"] == "dflash2"
    old = tmp_path / "old.ckpt"
    torch.save(legacy(ckpt), old)
    assert "conv" not in torch.load(old, weights_only=True)["drafter_config"]
    # export: the same folder as from the checkpoint as written now
    assert read_checkpoint(old)[0] == read_checkpoint(step3)[0]
    new_folder, old_folder = export_checkpoint(step3, tmp_path / "new"), export_checkpoint(old, tmp_path / "old")
    assert (old_folder / "config.json").read_text() == (new_folder / "config.json").read_text()
    # resume: no setting reported changed, the run goes on
    cli, _, _ = fit(resume_config, tmp_path / "a", f"--ckpt_path={old}", "--trainer.max_steps=4")
    changed = [r.getMessage() for r in caplog.records if "changed settings" in r.getMessage()]
    assert cli.trainer.global_step == 4 and changed and not any("drafter" in m or "selector" in m for m in changed)
    # warm start of a new run from it
    cli, _, _ = fit(resume_config, tmp_path / "b", f"--model.init_from={old}", "--trainer.max_steps=1")
    assert cli.trainer.global_step == 1


def test_a_legacy_pickled_drafter_config_comes_back_with_its_parts():
    import pickle

    cfg = DrafterConfig(variant="dflash2")
    state = {k: v for k, v in vars(cfg).items() if k not in ("conv", "selector")}
    state |= {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 5}
    old = object.__new__(DrafterConfig)
    old.__dict__.update(state)
    back = pickle.loads(pickle.dumps(old))
    assert (back.conv.kernel_size, back.conv.group_size, back.selector.rank, back.selector.top_k) == (3, 8, 4, 5)
    assert not hasattr(back, "conv_kernel_size") and json.dumps(back.to_dict())


def test_fp8_training_leaves_the_linears_a_part_reads_by_hand():
    """`model.fp8=all` converts the backbone's linears and the convolutions', never the selector's projection, whose
    weight the head loop reads as a tensor (`Part.fp8_exempt`)."""
    pytest.importorskip("torchao")
    from test_dflash2 import dflash2_config

    from dflash_lightning.fp8 import convert_linears
    from dflash_lightning.model import DFlashDrafter

    drafter = convert_linears(DFlashDrafter(dflash2_config(rank=16)), "tensorwise", emulate=True)
    assert type(drafter.candidate_selector.hidden_projection) is torch.nn.Linear
    assert type(drafter.layers[0].self_attn.q_proj) is not torch.nn.Linear
    assert type(drafter.layers[0].mlp_conv.kernel_projection) is not torch.nn.Linear


def test_help_groups_each_parts_settings_with_their_docstrings(capsys):
    from dflash_lightning.commands.cli import cli_main

    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Block convolutions (dflash2, lilicorr-conv): --model.drafter.conv CONFIG" in text
    assert "--model.drafter.conv.kernel_size KERNEL_SIZE Taps k of each convolution" in text
    assert "--model.drafter.selector.loss_weight LOSS_WEIGHT Weight alpha of the selector's K-way CE" in text
    assert "--model.drafter.lilicorr.candidate_topk CANDIDATE_TOPK K: candidates per slot" in text


@pytest.mark.parametrize(("objective", "weights", "wrong", "fix"), [
    ("ce", "dpace", "model.loss_weights=dpace", "model.loss_weights=decay"),
    ("kl", "decay", "model.objective=kl", "model.objective=ce"),
    ("ce+kl", "dpace", r"model.objective=ce\+kl, model.loss_weights=dpace",
     "model.objective=ce and model.loss_weights=decay"),
])
@pytest.mark.parametrize("part", [p for p in ALL_PARTS if p.own_loss])
def test_a_part_with_its_own_loss_names_only_the_settings_that_differ(part, objective, weights, wrong, fix):
    """XPress, Domino and DSpark train with their own loss (CE over decay weights): a run that sets another names the
    setting that differs, and only it, first, then what to set it to."""
    from dflash_lightning.parts.base import RunSettings

    assert {p.name for p in ALL_PARTS if p.own_loss} == {"xpress", "domino", "dspark_heads"}
    run = RunSettings(objective=objective, loss_weights=weights, gamma=4.0, gamma_set=False, final_hidden=True)
    with pytest.raises(ConfigError, match=f"^{wrong}: .* loss: set {fix}$"):
        part.check_run(part.settings_type(), run)
    part.check_run(part.settings_type(), RunSettings("ce", "decay", 4.0, False, True))  # its own loss: accepted


def test_the_names_table_says_each_parts_names_as_the_code_does():
    """docs/parts.md's "One name per concept" table has one row per part: its part name (the settings'), its metric
    prefix, its weight prefix and its folder fields as the code has them."""
    docs = (PACKAGE.parent / "docs/parts.md").read_text()
    table = docs.split("## One name per concept", 1)[1].split("\n\n")[2].splitlines()[2:]
    rows = {cells[1].strip(" `"): cells for line in table if (cells := [c.strip() for c in line.split("|")[1:-1]])}
    assert set(rows) == {part.name for part in ALL_PARTS}, "one row per part, named by its part name"
    for part in ALL_PARTS:
        _, _, metrics, weights, folder, _ = rows[part.name]
        assert metrics == (f"`{part.prefix()}/`" if part.metric(4) is not None else "none"), part.name
        assert part.weight_prefix is None or f"`{part.weight_prefix}.*`" in weights, part.name
        for key in part.config_fields:  # LiLiCorr's eight are written `lilicorr_<field>`
            assert key in folder or key.startswith("lilicorr_") and "`lilicorr_<field>`" in folder, (part.name, key)
