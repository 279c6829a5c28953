"""The part contract (dflash_lightning/parts/base.py) held for every part and every preset at once (torchtitan's
test_train_spec.py checks its registry with llama3's spec and a fake one; here every entry is checked): each part
registered once and named only in parts/, the folder's fields and weights round trip, every weight the backbone's or
one part's, every part's metric names prefixed and logged, warm start from every other preset (refused in one line,
or the rest dropped with one logged line), greedy decoding lossless with each part's served report, and sampled
decoding lossless by an exact chi-square test.

A new part adds its small settings to `TINY`; a new preset needs nothing here.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_evaluate import PROMPTS
from test_module import batch_with_features
from test_speculative import check_sampling_is_lossless
from transformers import AutoModelForCausalLM, AutoTokenizer

import dflash_lightning
from dflash_lightning.config import PART_SETTINGS, ConfigError, DrafterConfig
from dflash_lightning.decoding.evaluate import evaluate
from dflash_lightning.folder.reader import import_folder
from dflash_lightning.folder.serve import print_serve_commands, serve_commands
from dflash_lightning.folder.writer import write_folder
from dflash_lightning.hf.modeling_dflash import __all__ as REMOTE_CLASSES
from dflash_lightning.long_runs.warm_start import warm_start
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.module import DFlashModule
from dflash_lightning.parts.base import calibrates, overrides
from dflash_lightning.parts.convolutions import ConvSettings
from dflash_lightning.parts.domino import DominoSettings
from dflash_lightning.parts.dspark import DSparkSettings
from dflash_lightning.parts.lilicorr import LiLiCorrSettings
from dflash_lightning.parts.presets import ALL_PARTS, PRESETS, Preset, preset
from dflash_lightning.parts.selector import SelectorSettings
from dflash_lightning.parts.xpress import XPressSettings
from dflash_lightning.target_model import load_target_config, tokenizer_ids

PACKAGE = Path(dflash_lightning.__file__).parent
TINY = {
    "conv": ConvSettings(group_size=8),
    "selector": SelectorSettings(rank=4, top_k=3),
    "lilicorr": LiLiCorrSettings(candidate_topk=4, hidden_size=16, factor_dim=8, num_layers=1, num_heads=2),
    "dspark_heads": DSparkSettings(markov_rank=4),
    "domino": DominoSettings(gru_hidden_dim=8, emb_dim=4),
    # 2 Jacobi passes: blocks of 4 and 8 drafted unconverged; Gumbel drafts with their q where sampled
    "xpress": XPressSettings(rank=16, mlp_hidden=64, num_passes=2, sampled_drafts=True),
}
"""Settings of every part small enough for the tiny targets (width 32 or 64, vocabulary 5 or 69)."""
VARIANTS = list(PRESETS)


def tiny_config(variant: str, block_size: int = 4) -> DrafterConfig:
    """A two-layer drafter config of the preset, its parts' settings `TINY`'s."""
    parts = {part.name: TINY[part.name] for part in preset(variant).parts}
    return DrafterConfig(num_layers=2, block_size=block_size, gamma=4.0, variant=variant, **parts)


def random_drafter(target: Path, variant: str, seed: int = 0, block_size: int = 4) -> DFlashDrafter:
    """A drafter of the preset for the target, every weight moved off its initialisation (parts included: identity
    convolutions would hide a lost weight), without the target's embedding and head."""
    cfg = tiny_config(variant, block_size).resolved(load_target_config(str(target)), *tokenizer_ids(str(target)))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    for p in drafter.parameters():
        p.data += 0.1 * torch.randn_like(p)
    return drafter.eval()


@pytest.fixture(scope="module")
def folders(tiny_target, tmp_path_factory) -> dict[str, tuple[DFlashDrafter, Path]]:
    """Every preset's random drafter and its exported folder (fp32)."""
    out = tmp_path_factory.mktemp("presets")
    made = {}
    for i, variant in enumerate(VARIANTS):
        drafter = random_drafter(tiny_target, variant, seed=i)
        made[variant] = drafter, write_folder(drafter.config, drafter.state_dict(), out / variant)
    return made


# -- registration --------------------------------------------------------------------------------------------------
def test_each_part_is_registered_once():
    """The presets' parts are the only list of parts: PART_SETTINGS follows from them, DrafterConfig has exactly one
    settings field per part (its own dataclass, for --help), names never collide, every preset's layout resolves."""
    assert len({part.name for part in ALL_PARTS}) == len({part.prefix() for part in ALL_PARTS}) == len(ALL_PARTS)
    assert PART_SETTINGS == {part.name: part.settings_type for part in ALL_PARTS}
    settings_fields = {f.name: f.default_factory for f in fields(DrafterConfig) if f.default_factory in
                       set(PART_SETTINGS.values())}
    assert settings_fields == PART_SETTINGS
    assert set(TINY) == set(PART_SETTINGS), "a new part adds its small settings to TINY"
    for variant, row in PRESETS.items():
        assert tiny_config(variant).layout == row.layout
        assert len([part for part in row.parts if part.decodes]) <= 1, variant


def test_parts_that_name_different_layouts_cannot_share_a_preset():
    """A preset's layout is its parts' (section 3's where none names one); two that disagree are refused where the
    preset is made."""
    fill_in = next(part for part in ALL_PARTS if part.layout is None)
    named = [part for part in ALL_PARTS if part.layout is not None]
    for part in named:
        assert Preset((fill_in, part), "X").layout == part.layout
    other = type("Other", (named[0],), {"layout": replace(named[0].layout, last_slot_drafts=False)})
    with pytest.raises(ValueError, match="the parts of a preset name different block layouts: "):
        Preset((named[0], other), "X")


def test_parts_whose_terms_cannot_train_together_are_refused_where_the_preset_is_made():
    """Two drafting rules, two denominators of the step's loss, or a part that works alone in the head loop beside
    another part in it: `Preset` refuses them in one line naming the parts, before any drafter or run exists."""
    decoders = [type(p.__name__, (p,), {"layout": None}) for p in ALL_PARTS if p.decodes]  # layouts apart
    for a, b in itertools.combinations(decoders, 2):
        with pytest.raises(ValueError, match=rf"^the parts of a preset cannot train together: .*two parts draft "
                                             rf"\(Part.decodes\): {a.__name__}, {b.__name__}"):
            Preset((a, b), "X")
    quiet = {"decodes": False}  # each below breaks one rule only
    in_loop = type("InLoop", (next(p for p in ALL_PARTS if p.name == "selector"),), quiet)
    for part in ALL_PARTS:
        if part.alone_in_loop or overrides(part, "logit_correction"):
            with pytest.raises(ValueError, match=f"{part.__name__} cannot share the head loop with InLoop: it "):
                Preset((part, in_loop), "X")
    assert {p.name for p in ALL_PARTS if p.alone_in_loop or p.name == "domino"} == {"dspark_heads", "domino"}
    xpress = next(p for p in ALL_PARTS if p.name == "xpress")
    counted = type("Counted", (in_loop,), {"loss_denominator": lambda self, batch: None})
    with pytest.raises(ValueError, match=r"two parts set the loss's denominator \(Part.loss_denominator\): "
                                         r"XPress, Counted"):
        Preset((xpress, counted), "X")
    Preset((in_loop, next(p for p in ALL_PARTS if p.name == "conv")), "X")  # sharing the loop and the backbone: fine


def test_no_file_outside_parts_names_a_part():
    """Outside parts/ no code names a part's class (config.py names the settings dataclasses once, for --help) nor
    reads a variant's layout or drafting state by name: `sample_from_anchor` is only the folder key export checks."""
    classes = {part.__name__ for part in ALL_PARTS}
    settings = {part.settings_type.__name__ for part in ALL_PARTS}
    found = []
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith(("parts/", "hf/")):  # the served modelling file stands alone
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            words = set(re.findall(r"\w+", line))
            named = words & classes | (words & settings if name != "config.py" else set())
            named |= words & {"last_confidence"}
            named |= words & {"sample_from_anchor"} if name != "folder/codec.py" else set()
            found += [f"{name}:{number} {sorted(named)}"] if named else []
    assert not found, found


# -- export and import, weight ownership ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_folder_round_trip_carries_every_parts_fields_and_weights(folders, tmp_path, variant):
    drafter, folder = folders[variant]
    cfg = drafter.config
    c = json.loads((folder / "config.json").read_text())
    assert c["architectures"] == [cfg.preset.architecture]
    assert ("auto_map" in c) == (cfg.preset.architecture in REMOTE_CLASSES)  # transformers' class, where one exists
    for part in cfg.preset.parts:
        settings = getattr(cfg, part.name)
        assert part.export_fields(settings, cfg).items() <= c["dflash_config"].items(), part.name
        assert part.top_level_fields(settings, cfg).items() <= c.items(), part.name
    back, state = import_folder(folder)
    assert back.variant == variant and back.layout == cfg.layout
    training = set(cfg.training_fields())  # choices a folder does not carry
    assert {k: v for k, v in back.flat_dict().items() if k not in training} == {
        k: v for k, v in cfg.flat_dict().items() if k not in training}
    expected = drafter.state_dict()
    assert set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in expected)
    again = write_folder(replace(back, gamma=4.0), state, tmp_path / "again")  # import's config, exported again
    assert (again / "config.json").read_text() == (folder / "config.json").read_text()


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_commands_follow_the_preset_and_its_layout(folders, variant, monkeypatch, capsys):
    """vLLM's command serves the layout's drafts a block with the parts' own keys (`Part.speculative_config`); an
    engine without a runtime for the preset gets no command, and `export`'s printout says so."""
    drafter, folder = folders[variant]
    cfg, row = drafter.config, drafter.config.preset
    commands = serve_commands(folder, cfg, "T")
    assert ("vllm" in commands) == (row.vllm_method is not None)
    assert ("sglang" in commands) == (row.sglang_algorithm is not None)
    if "vllm" in commands:
        spec = json.loads(commands["vllm"].split("--speculative-config ", 1)[1].strip("'"))
        extra = {k: v for part in row.parts for k, v in part.speculative_config(getattr(cfg, part.name)).items()}
        assert spec == {"method": row.vllm_method, "model": str(folder),
                        "num_speculative_tokens": cfg.layout.drafts(cfg.block_size), **extra}
    if "sglang" in commands:
        flags = [flag for part in row.parts for flag in part.sglang_args(getattr(cfg, part.name))]
        assert commands["sglang"].endswith(" ".join([f"--speculative-{row.sglang_algorithm.lower()}-block-size "
                                                     f"{cfg.block_size}", *flags]))
        assert f"--speculative-algorithm {row.sglang_algorithm} " in commands["sglang"]
    print_serve_commands(folder, cfg, "T", "bfloat16")
    printed = capsys.readouterr().out
    assert ("SGLang: no runtime serves this drafter" in printed) == ("sglang" not in commands)
    monkeypatch.setitem(PRESETS, variant, replace(row, vllm_method=None))
    print_serve_commands(folder, cfg, "T", "bfloat16")
    printed = capsys.readouterr().out
    assert "vllm serve" not in printed and "vLLM: no runtime serves this drafter" in printed
    assert ("sglang.launch_server" in printed) == ("sglang" in commands)
    notes = [note for part in row.parts for note in part.serve_notes(getattr(cfg, part.name))]
    assert all(f"\n{note}\n" in printed for note in notes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_weight_is_the_backbones_or_one_parts(folders, variant):
    """`Part.owns` (called on the class, as warm start calls it) claims each part's weights and nothing else; the
    rest are exactly a plain DFlash drafter's of the same shape."""
    drafter, _ = folders[variant]
    backbone = set(DFlashDrafter(replace(drafter.config, variant="dflash")).state_dict())
    parts = drafter.config.preset.parts
    owned: dict[str, list[str]] = {part.name: [] for part in parts}
    for key in drafter.state_dict():
        owners = [part.name for part in parts if part.owns(key)]
        assert (key in backbone) + len(owners) == 1, (key, owners)
        for name in owners:
            owned[name].append(key)
    assert all(owned.values()), owned
    assert backbone <= set(drafter.state_dict())


# -- metrics -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def features_batch(tiny_target):
    """A packed batch with the target's features for a two-layer drafter (every preset's: the same layer ids)."""
    ids = tiny_config("dflash").resolved(load_target_config(str(tiny_target)), *tokenizer_ids(str(tiny_target))
                                        ).target_layer_ids
    batch = batch_with_features(tiny_target, ids)
    batch["final_hidden"] = torch.randn(batch["input_ids"].numel(), 64, generator=torch.Generator().manual_seed(0))
    return batch


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parts_metric_names_carry_its_prefix_and_are_logged(tiny_target, features_batch, variant):
    """Each part's step logs (`PartOutput.logs`) and metric values (`Part.metric`) are named `<prefix>/...`
    (`Part.prefix`), and one measured training step of the module logs them all as `train/<prefix>/...`."""
    module = DFlashModule(str(tiny_target), tiny_config(variant), token_budget=64, num_anchors=8,
                          loss_weights="decay")
    module.configure_model()
    batch = {k: v for k, v in features_batch.items() if k != "final_hidden" or module.needs_final_hidden}
    out = module.step(batch, max(module.hparams.topk), torch.Generator().manual_seed(0))
    expected = set()
    for part in module.drafter_config.preset.parts:
        names = set(out.parts[part.name].logs)
        if part.name in module.train_metrics.parts:
            metric = module.train_metrics.parts[part.name]
            metric.update(out.parts[part.name].rows, out.labels, out.supervised)
            names |= set(metric.compute())
            metric.reset()
        assert all(name.startswith(part.prefix() + "/") for name in names), (part.name, sorted(names))
        expected |= {f"train/{name}" for name in names}
    logged = {}
    module.log = lambda name, value, **kw: logged.setdefault(name, value)
    module.training_step(batch, 0)  # batch 0: a measured step
    assert {"train/loss", "train/acc", "train/tau"} | expected <= set(logged)


# -- warm start ----------------------------------------------------------------------------------------------------
PAIRS = [(source, run) for source, run in itertools.product(VARIANTS, VARIANTS) if source != run]


@pytest.mark.parametrize(("source", "run"), PAIRS, ids=[f"{source}->{run}" for source, run in PAIRS])
def test_warm_start_from_every_other_preset(tiny_target, folders, caplog, source, run):
    """`model.init_from` a drafter of another preset: refused in one line naming the parts where the source has a part
    that shaped its backbone and the run lacks it; else the backbone's and the shared parts' weights are the source's,
    the run's own parts keep their initialisation, and what is dropped (the source's other parts) or changed (the
    block layout) is said in one logged line, only then."""
    drafter = random_drafter(tiny_target, run, seed=99)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    src, folder = folders[source]
    theirs, ours = src.config.preset.parts, drafter.config.preset.parts
    only_theirs = [part for part in theirs if part not in ours]
    if any(part.changes_backbone for part in only_theirs):
        with pytest.raises(ConfigError) as refused:
            warm_start(drafter, str(folder))
        message = str(refused.value)
        assert "\n" not in message and f"cannot start a {run} run" in message
        assert all(part.name in message for part in only_theirs if part.changes_backbone), message
        return
    with caplog.at_level("INFO"):
        warm_start(drafter, str(folder))
    source_state = src.state_dict()
    for key, value in drafter.state_dict().items():
        fresh = any(part.owns(key) for part in ours if part not in theirs)
        assert torch.equal(value, before[key] if fresh else source_state[key]), key
    lines = [r.getMessage() for r in caplog.records if "model.init_from" in r.getMessage()]
    relayout = src.config.layout.anchor_first != drafter.config.layout.anchor_first
    assert len(lines) == (1 if only_theirs or relayout else 0), lines
    if only_theirs:
        assert "weights are not used" in lines[0] and all(part.name in lines[0] for part in only_theirs), lines
    if relayout:
        assert "anchor-first" in lines[0] and "fill-in" in lines[0], lines


def test_warm_start_refuses_another_shape_in_one_line(tiny_target, folders):
    drafter = random_drafter(tiny_target, "dspark", block_size=5)
    with pytest.raises(ConfigError, match=r"^model.init_from '.*': its drafter differs from this run's in "
                                          r"block_size$"):
        warm_start(drafter, str(folders["dflash"][1]))


# -- decoding ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


GREEDY = pytest.mark.pinned_only(  # evaluate's calls into the target and tokenizer are those of DFlash at block 8
    same_path_as="tests/test_contract.py::test_greedy_decoding_is_lossless_with_each_parts_served_report[dflash-8]")


@pytest.mark.parametrize("block_size", [pytest.param(2, marks=GREEDY), pytest.param(4, marks=GREEDY), 8])
@pytest.mark.parametrize("variant", [v if v == "dflash" else pytest.param(v, marks=GREEDY) for v in VARIANTS])
def test_greedy_decoding_is_lossless_with_each_parts_served_report(tiny_target, target_model, variant, block_size):
    """`evaluate` at temperature 0: every prompt's tokens are the target's own greedy ones; each step drafted the
    layout's drafts (the drafting rule saw the drafting slots' states and the whole block's) and recorded the
    drafting part's extras of each, and each part's served report (`Part.served_report`: DSpark's adaptive
    verification) is in the report; a part that calibrates fits the served blocks and folds the fit into its own
    weights only."""
    drafter = random_drafter(tiny_target, variant, seed=block_size, block_size=block_size)
    layout, seen = drafter.config.layout, []
    rule = next((part for part in drafter.parts if part.decodes), None)
    if rule is not None:  # what the drafting rule sees: the drafting slots' states, and the whole block's
        own = rule.draft
        rule.draft = lambda inputs: seen.append(inputs) or own(inputs)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    report = evaluate(drafter, target_model, tokenizer, PROMPTS, max_new_tokens=16, progress=False, warmup=False)
    for inputs in seen:
        assert inputs.block_hidden.shape[0] == block_size
        assert torch.equal(inputs.block_hidden[layout.draft_slots(block_size)], inputs.hidden)
    assert len(seen) == (0 if rule is None else sum(r["steps"] for r in report["prompts"]))
    drafts = layout.drafts(block_size)
    assert report["mismatches"] == 0 and len(report["acceptance_histogram"]) == drafts + 1
    for record in report["prompts"]:
        for name, per_step in record["extras"].items():
            assert [len(values) for values in per_step] == [drafts] * record["steps"], name
    state = drafter.state_dict()
    for part in drafter.config.preset.parts:
        assert part.served_report(report["prompts"]).items() <= report.items(), part.name
        if calibrates(part):  # what it fits on served blocks is JSON, and folds into its own weights only
            fit = json.loads(json.dumps(part.calibrate(report["prompts"], state).fit))
            folded = part.fold_calibration(state, fit, "calibration.json")
            assert {k for k in state if not torch.equal(folded[k], state[k])} <= {k for k in state if part.owns(k)}


SAMPLERS = {part.name: variant for variant in reversed(VARIANTS) for part in preset(variant).parts
            if part.decodes and part.samples}
"""Each drafting part that samples (its `Draft.q`), in the first preset that has it (its q is the part's, whatever
else the preset holds); one that drafts point masses at every temperature is held to section 6b by the greedy test
and test_speculative.py's table of point-mass drafts."""


@pytest.mark.pinned_only(  # check_sampling_is_lossless's calls into the target, as there; the samplers are ours
    same_path_as="tests/test_speculative.py::test_speculative_sampling_is_lossless[table]")
@pytest.mark.parametrize("variant", SAMPLERS.values(), ids=list(SAMPLERS))
def test_sampled_decoding_is_lossless(variant):
    """Temperature 1 with the preset's drafting rule, its parts' weights off their initialisation: the sequences
    follow the target's exact distribution (tests/test_speculative.py `check_sampling_is_lossless`, chi-square over
    all 5^5 sequences); the drafts are the training forward's. DFlash2's selector samples from q = softmax(score / T)
    over its K candidates, LiLiCorr's walk from q = softmax(row / T) over its K, row the sampled predecessor's pair
    row, DSpark from softmax(z / T) with the Markov head fed each sampled token: all verified with min(1, P/q) and
    the residual max(0, P - q) (section 10; a residual of P without d_k fails it, checked once each). The presets
    whose drafts are the backbone's argmax (point masses, section 6b) are held to it by test_speculative.py's
    `sliding` and `table` cases."""
    parts = {part.name: TINY[part.name] for part in preset(variant).parts}
    check_sampling_is_lossless({"variant": variant, **parts}, noise=True)


def test_parts_check_the_run_when_the_module_is_built_and_when_fitting_starts(tiny_target, monkeypatch):
    """`Part.check_run` sees the run's settings when the module is built (no total yet), and again with the Trainer's
    total steps when the optimizer is configured (fitting starts); its one-line refusal stops either."""
    seen = []
    for part in ALL_PARTS:
        monkeypatch.setattr(part, "check_run", classmethod(lambda cls, settings, run: seen.append((cls.name, run))))
    module = DFlashModule(str(tiny_target), tiny_config("lilicorr-conv"), token_budget=64, num_anchors=8,
                          loss_weights="decay")
    assert [(name, run.total_steps) for name, run in seen] == [("conv", None), ("lilicorr", None)]
    run = seen[0][1]
    assert (run.objective, run.loss_weights, run.gamma, run.gamma_set, run.final_hidden) == (
        "ce", "decay", 4.0, True, True)  # LiLiCorr's penalty reads the target's final hidden states
    module.configure_model()
    module._trainer = SimpleNamespace(estimated_stepping_batches=12)
    module.configure_optimizers()
    assert [(name, run.total_steps) for name, run in seen[2:]] == [("conv", 12), ("lilicorr", 12)]

    def refuse(cls, settings, run):
        if run.total_steps == math.inf:
            raise ConfigError("trainer.max_steps: the run has no end")

    monkeypatch.setattr(ALL_PARTS[0], "check_run", classmethod(refuse))
    module._trainer = SimpleNamespace(estimated_stepping_batches=math.inf)
    with pytest.raises(ConfigError, match="^trainer.max_steps: the run has no end$"):
        module.configure_optimizers()
