"""LiLiCorr drafters (docs/method.md section 11) end to end: the decoder's walk is the training lattice's, the module
trains, compiles, exports and evaluates them (greedy losslessness, the folder's round trip and warm starts across
the presets: tests/test_contract.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from test_features_cache import SHARD_GB, setup  # noqa: F401 (fixture)
from test_speculative import random_drafter, random_prompts, target  # noqa: F401 (fixture)

from dflash_lightning.blocks import slot_weights
from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.decoding.speculative import SpeculativeDecoder
from dflash_lightning.folder.reader import import_folder
from dflash_lightning.folder.writer import write_folder
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.convolutions import ConvSettings
from dflash_lightning.parts.lilicorr import GEOMETRY, LiLiCorrSettings, greedy_walk

# small geometry for the tiny target (H 64, V 64): K 4, Hh 16, F 8, one layer of two heads
LATTICE = LiLiCorrSettings(candidate_topk=4, hidden_size=16, factor_dim=8, num_layers=1, num_heads=2)
LILICORR = {"variant": "lilicorr", "lilicorr": LATTICE}
LILICORR_CONV = {"variant": "lilicorr-conv", "conv": ConvSettings(group_size=8), "lilicorr": LATTICE}


class WalkRecorder(SpeculativeDecoder):
    """Records each step's block start and the drafts the part's walk proposed."""

    def __init__(self, target_model, drafter) -> None:
        super().__init__(target_model, drafter)
        self.steps: list[tuple[int, list[int]]] = []

    def draft(self, context, x, start, *sampling):
        drafted = super().draft(context, x, start, *sampling)
        self.steps.append((start, drafted.tokens.tolist()))
        return drafted


def test_the_decoders_walk_is_the_training_lattices_over_a_whole_prefix(target):  # noqa: F811
    """Every greedy block the decoder drafted equals the greedy walk of the training forward's lattice for the same
    anchor, over the target features of the whole verified sequence (candidates, l, c_{p-1}, scores: one rule)."""
    drafter = random_drafter(target, 4, seed=3, **LILICORR_CONV).double()
    drafter.set_target_io(target.get_input_embeddings().weight.detach().double(),
                          target.get_output_embeddings().weight.detach().double())
    decoder = WalkRecorder(target, drafter)
    prompt = random_prompts(1, seed=7)[0]
    out = decoder.generate(prompt, 24)
    ids = torch.cat([prompt, torch.tensor(out.tokens)])
    with torch.no_grad():
        states = target(input_ids=ids[None], output_hidden_states=True).hidden_states
        features = torch.cat([states[j + 1][0] for j in decoder.layer_ids], -1).double()
        final = states[-1][0].double()  # the target's final normed hidden states (section 4c's teacher)
        starts = torch.tensor([s for s, _ in decoder.steps])
        n = ids.numel()
        train = drafter(features, ids, torch.arange(n), torch.zeros_like(ids), torch.ones(n, dtype=torch.bool),
                        starts, torch.ones_like(starts, dtype=torch.bool), slot_weights(4, 4.0).double(),
                        final_hidden=final)
    start, pair, cand = train.parts["lilicorr"].rows
    walked = cand.gather(-1, greedy_walk(start, pair)[..., None])[..., 0]  # [steps, B-1]
    assert len(decoder.steps) > 4  # several blocks, each at p > 0 (c_{p-1} read)
    assert walked.tolist() == [drafts for _, drafts in decoder.steps]


@pytest.mark.parametrize("hidden_size,std", [(16, 0.7), (0, None)], ids=["token_proj", "no-token_proj"])
def test_a_folder_is_section_11s_whatever_the_token_proj_init(target, tmp_path, hidden_size, std):  # noqa: F811
    """token_proj_std is a training setting: through the drafter's own init it sets token_proj's std, and the folder
    holds section 11's fields and weight names (token_proj exactly when Hh != H), nothing of the setting."""
    from safetensors import safe_open
    from test_lilicorr import section_11_names

    lattice = replace(LATTICE, hidden_size=hidden_size, token_proj_std=std)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig(num_layers=1, block_size=8, mask_token_id=52, gamma=4.0,
                                          **{**LILICORR_CONV, "lilicorr": lattice}).resolved(target.config))
    if std is not None:  # the backbone's generic init ran first; the part's own wins
        assert float(drafter.lilicorr.token_proj.weight.std()) == pytest.approx(std, rel=0.1)
    folder = write_folder(drafter.config, drafter.state_dict(), tmp_path / "d")
    dflash = json.loads((folder / "config.json").read_text())["dflash_config"]
    assert {k for k in dflash if k.startswith("lilicorr")} == {"lilicorr_enabled", *(f"lilicorr_{n}" for n in GEOMETRY)}
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = {k for k in f.keys() if k.startswith("lilicorr.")}
    assert names == section_11_names(1, token_proj=hidden_size not in (0, target.config.hidden_size))
    assert import_folder(folder)[0].lilicorr == replace(lattice, token_proj_std=None)



def test_a_lilicorr_step_without_the_final_hidden_state_is_refused_naming_the_setting(target):  # noqa: F811
    """Online, the CLI links target.final_hidden to the variant; objects wired by hand are checked in one line."""
    from types import SimpleNamespace

    from dflash_lightning.target_model.wiring import check_wiring

    module = SimpleNamespace(drafter_config=random_drafter(target, 8, **LILICORR).config, needs_final_hidden=True,
                             loss_settings=SimpleNamespace(distills=False, objective="ce"),
                             hparams=SimpleNamespace(target="t", token_budget=64))
    features = SimpleNamespace(path="t", final_hidden=False, feature_cache=None, layer_ids=None, token_budget=None)
    with pytest.raises(ConfigError, match=r"^target\.final_hidden False differs from model\.drafter\.variant "
                                          r"\(lilicorr: reads the target's final hidden states\) True"):
        check_wiring(module, None, features)


@pytest.fixture(scope="module")
def lilicorr_run(tmp_path_factory):
    """A 4-step LiLiCorr+conv fit through the CLI on the small config (online target, final hidden states linked)."""
    import yaml
    from test_cli import four_step_config

    from dflash_lightning.commands.cli import cli_main

    root = tmp_path_factory.mktemp("lilicorr")
    config = four_step_config(root)
    config["model"]["drafter"].update(variant="lilicorr-conv", conv={"group_size": 8}, lilicorr={
        "candidate_topk": 4, "hidden_size": 16, "factor_dim": 8, "num_layers": 1, "num_heads": 2})
    config["spec_eval"] = {"prompts": str(root / "val.jsonl"), "every_n_steps": 2, "num_prompts": 2,
                           "max_new_tokens": 8}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return cli_main(["fit", "--config", str(path), "--model.metrics_every=2"]), root


def test_lilicorr_trains_through_the_module_and_logs_its_metrics(lilicorr_run):
    cli, _ = lilicorr_run
    trainer, module = cli.trainer, cli.model
    assert trainer.global_step == 4 and module.needs_final_hidden
    assert cli.config_init.fit.target.final_hidden is True  # linked from the variant's part, not the objective
    logged = trainer.logged_metrics
    for key in ("train/loss", "train/tau", "train/lilicorr/loss", "train/lilicorr/tau", "train/lilicorr/oracle_tau",
                "train/lilicorr/recall", "train/lilicorr/spread", "val/lilicorr/tau", "val/tau_served"):
        assert key in logged, key
    assert logged["val/speculative_mismatches"] == 0  # the walk's greedy drafts, served losslessly
    assert float(logged["train/lilicorr/spread"]) > 0  # the scores have not collapsed
    grads = module.drafter.lilicorr.in_head.weight
    assert not torch.equal(grads, torch.zeros_like(grads))


def test_a_lilicorr_checkpoint_exports_and_imports(lilicorr_run, tmp_path):
    from dflash_lightning.folder.writer import export_checkpoint

    _, root = lilicorr_run
    ckpt = root / "runs" / "checkpoints" / "last.ckpt"
    folder = export_checkpoint(ckpt, tmp_path / "out")
    cfg, state = import_folder(folder)
    assert cfg.variant == "lilicorr-conv" and cfg.lilicorr.candidate_topk == 4
    assert any(k.startswith("lilicorr.layers.0.attn.in_proj_weight") for k in state)


def test_compiled_lilicorr_step_equals_the_eager_one_without_recompiling(tiny_target):
    """`model.compile` compiles the lattice's terms too (`Part.compile_hooks`): the same loss and gradients as eager,
    and a second batch of other anchors and labels reuses the graphs; a batch without the final hidden states is
    refused naming the variant."""
    from dataclasses import replace

    from test_module import batch_with_features
    from torch._dynamo.utils import counters

    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.module import DFlashModule

    # K 16 of the tiny target's 60 tokens: an untrained drafter's labels are often among its candidates
    drafter = DrafterConfig(num_layers=2, block_size=8,
                            **{**LILICORR_CONV, "lilicorr": replace(LATTICE, candidate_topk=16)})
    modules = []
    for compile in (False, True):
        torch.manual_seed(0)
        module = DFlashModule(str(tiny_target), replace(drafter), token_budget=64, num_anchors=8, compile=compile)
        module.configure_model()
        modules.append(module)
    eager, compiled = modules
    compiled.load_state_dict(eager.state_dict())
    batch = batch_with_features(tiny_target, eager.drafter_config.target_layer_ids)
    with pytest.raises(RuntimeError, match="model.drafter.variant 'lilicorr-conv' needs the target's final hidden"):
        eager.step(batch)
    batch["final_hidden"] = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    counters.clear()
    for seed in (3, 4):
        outs = [m.step(batch, generator=torch.Generator().manual_seed(seed)) for m in (eager, compiled)]
        for m, out in zip((eager, compiled), outs, strict=True):
            m.drafter.zero_grad()
            out.loss.backward()
        torch.testing.assert_close(outs[0].loss, outs[1].loss, rtol=1e-5, atol=1e-5)
        for name in ("lilicorr.in_head.weight", "fc.weight", "layers.0.mlp_conv.kernel_projection.weight"):
            grads = [m.drafter.get_parameter(name).grad for m in (eager, compiled)]
            torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
        assert float(outs[0].parts["lilicorr"].logs["lilicorr/supervised"]) > 0  # the lattice loss is not empty
    assert compiled.drafter.lilicorr.lattice_terms is not eager.drafter.lilicorr.lattice_terms
    assert not counters["recompiles"], dict(counters["recompiles"])


def test_evaluate_walks_a_lilicorr_checkpoint_greedy_and_sampled(lilicorr_run, tmp_path):
    """`evaluate` on the fit's checkpoint: greedy walks reproduce the target's own output, sampled walks (q over the K
    candidates) are verified and counted like any drafts."""
    from dflash_lightning.commands.evaluate import main

    _, root = lilicorr_run
    out = tmp_path / "eval"
    main(["--drafter", str(root / "runs" / "checkpoints" / "last.ckpt"), "--prompts", str(root / "val.jsonl"),
          "--out", str(out), "--max_new_tokens", "12", "--num_prompts", "3", "--device", "cpu", "--dtype", "float32",
          "--temperature", "0,1", "--seed", "3"])
    greedy, sampled = json.loads((out / "report.json").read_text())["per_temperature"].values()
    assert greedy["mismatches"] == 0 and greedy["num_prompts"] == sampled["num_prompts"] == 3
    for run in (greedy, sampled):
        assert sum(run["acceptance_histogram"]) == run["steps"] > 0 and 1 <= run["expected_tau_pooled"] <= 8


LATTICE_ARGS = ["--model.drafter.variant=lilicorr-conv", "--model.drafter.conv.group_size=8",
                "--model.drafter.lilicorr.candidate_topk=4", "--model.drafter.lilicorr.hidden_size=16",
                "--model.drafter.lilicorr.factor_dim=8", "--model.drafter.lilicorr.num_layers=1",
                "--model.drafter.lilicorr.num_heads=2"]


def test_a_cache_written_for_lilicorr_holds_the_final_hidden_state_and_trains_it_offline(setup, tmp_path,  # noqa: F811
                                                                                         monkeypatch):
    """`cache` stores the final hidden states for a LiLiCorr config by default; a fit reads them from the cache and
    moves the lattice's and the convolutions' weights; a cache without them is refused in one line naming the flag."""
    from test_features_cache import check_cache_trains_a_part_offline

    check_cache_trains_a_part_offline(setup, tmp_path, LATTICE_ARGS, monkeypatch)
