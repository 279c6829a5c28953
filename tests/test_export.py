"""Export: the folder has exactly the published layout, round-trips, loads in transformers and serves as trained."""

from __future__ import annotations

import copy
import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import packed_batch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from dflash_lightning.commands.export import main
from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.decoding.speculative import SpeculativeDecoder, target_generate
from dflash_lightning.folder.reader import build_drafter, import_folder, load_drafter
from dflash_lightning.folder.serve import print_serve_commands
from dflash_lightning.folder.writer import export_checkpoint, write_config, write_folder
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.convolutions import ConvSettings
from dflash_lightning.parts.selector import SelectorSettings
from dflash_lightning.target_model import load_target_io


def make_checkpoint(target: Path, path: Path, block_size: int = 8, **module_kw) -> Path:
    """A real Lightning checkpoint of a DFlashModule after one training step on the tiny target."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from dflash_lightning.module import DFlashModule
    from dflash_lightning.target_model import TargetFeatures

    torch.manual_seed(0)
    module = DFlashModule(str(target), DrafterConfig(num_layers=2, block_size=block_size), token_budget=64,
                          num_anchors=8, **module_kw)
    features = TargetFeatures(str(target), dtype="float32", layer_ids=module.drafter_config.target_layer_ids,
                              final_hidden=module.loss_settings.distills)
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[features])
    trainer.fit(module, train_dataloaders=DataLoader([packed_batch([30, 20], 64, vocab=50)], batch_size=None))
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tiny_target, tmp_path_factory) -> Path:
    return make_checkpoint(tiny_target, tmp_path_factory.mktemp("ckpt") / "last.ckpt")


@pytest.fixture(scope="module")
def folder(checkpoint, tmp_path_factory) -> Path:
    return export_checkpoint(checkpoint, tmp_path_factory.mktemp("export") / "drafter")


def published_weight_names(layers: int) -> set[str]:
    """The weight names of docs/method.md section 7, written out independently of the model code."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(layers):
        names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names


def test_training_settings_ride_in_the_checkpoint_and_stay_out_of_the_served_folder(tiny_target, tmp_path, folder):
    """objective, loss weights, alpha, temperature: hyper-parameters of the checkpoint; config.json is unchanged."""
    from dflash_lightning.module import DFlashModule

    settings = {"objective": "ce+kl", "loss_weights": "dpace", "dpace_alpha": 0.3, "temperature": 2.0}
    path = make_checkpoint(tiny_target, tmp_path / "kl.ckpt", **settings)  # one distilling step, target online
    hp = torch.load(path, map_location="cpu", weights_only=False)["hyper_parameters"]
    assert {k: hp[k] for k in settings} == settings
    restored = DFlashModule(**hp)  # what a resume or load_from_checkpoint builds
    assert (restored.loss_settings.objective, restored.loss_settings.loss_weights) == ("ce+kl", "dpace")
    assert (restored.loss_settings.dpace_alpha, restored.loss_settings.temperature) == (0.3, 2.0)
    out = export_checkpoint(path, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())


def test_folder_has_the_published_layout(folder):
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    config = json.loads((folder / "config.json").read_text())
    assert set(config) == {
        "architectures", "model_type", "auto_map", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
        "max_position_embeddings", "vocab_size", "attention_bias", "hidden_act", "tie_word_embeddings", "layer_types",
        "use_sliding_window", "sliding_window", "num_target_layers", "block_size", "dflash_config", "dtype",
    }
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == 6 and config["block_size"] == 8
    assert config["dflash_config"] == {"mask_token_id": 52, "target_layer_ids": [1, 3]}
    assert config["tie_word_embeddings"] is False and config["layer_types"] == ["full_attention"] * 2
    assert config["use_sliding_window"] is False and config["sliding_window"] is None and "is_causal" not in config
    weights = load_file(folder / "model.safetensors")
    assert set(weights) == published_weight_names(2)
    assert weights["fc.weight"].shape == (64, 2 * 64)  # [H, K*H]
    source = (folder / "modeling_dflash.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "inspect", "torch", "transformers"}  # self-contained


def test_round_trip_keeps_config_and_weights(checkpoint, folder):
    ckpt = torch.load(checkpoint, weights_only=False)
    cfg, state = import_folder(folder)
    assert cfg.to_dict() == ckpt["drafter_config"]
    expected = {k.removeprefix("drafter."): v for k, v in ckpt["state_dict"].items()}
    assert set(state) == set(expected)
    for k, v in state.items():
        assert torch.equal(v, expected[k]), k
    # a folder re-exported from the imported weights is the same folder
    again = write_folder(cfg, state, folder.parent / "again")
    assert (again / "config.json").read_text() == (folder / "config.json").read_text()


def test_transformers_loads_the_folder_offline(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, info = AutoModel.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    assert type(model).__name__ == "DFlashDraftModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    weights = load_file(folder / "model.safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    bf16 = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16


def test_checkpoint_and_folder_load_the_same_drafter(tiny_target, checkpoint, folder):
    from_ckpt = load_drafter(checkpoint)  # the checkpoint names its target
    from_folder = load_drafter(folder, str(tiny_target))
    for (k, a), (_, b) in zip(from_ckpt.state_dict().items(), from_folder.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert torch.equal(from_folder.head_weight, load_target_io(str(tiny_target))[1])
    with pytest.raises(ValueError, match="give the target"):
        load_drafter(folder)


def broken_copy(folder: Path, dest: Path, edit_weights=None, edit_config=None) -> Path:
    dest.mkdir()
    weights, config = load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())
    if edit_weights:
        edit_weights(weights)
    if edit_config:
        edit_config(config)
    save_file(weights, dest / "model.safetensors")
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("edit,message", [
    (lambda w: w.pop("layers.1.mlp.up_proj.weight"), r"missing 'layers\.1\.mlp\.up_proj\.weight' \[128, 64\]"),
    (lambda w: w.update({"lm_head.weight": torch.zeros(60, 64)}), r"unexpected 'lm_head\.weight' \[60, 64\]"),
    (lambda w: w.update({"layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)}),
     r"'layers\.0\.self_attn\.q_proj\.weight' has shape \[32, 64\], the config implies \[64, 64\]"),
    (lambda w: w.update({"layers.0.self_attn.k_proj.bias": torch.zeros(32)}),
     r"unexpected 'layers\.0\.self_attn\.k_proj\.bias'"),
])
def test_folder_with_wrong_weights_is_refused(folder, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        import_folder(broken_copy(folder, tmp_path / "bad", edit_weights=edit))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.pop("block_size"), "lacks required field\\(s\\): block_size"),
    (lambda c: c["dflash_config"].pop("target_layer_ids"), "dflash_config.target_layer_ids"),
    (lambda c: c.pop("rope_theta"), "rope_theta"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 7]), r"target_layer_ids \[7\] out of range"),
    (lambda c: c.update(num_hidden_layers=3), r"missing 'layers\.2\."),  # config and weights disagree
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 5]), r"name the target's last layer \(5\)"),
    (lambda c: c.update(dtype="half"), r"dtype 'half' is not one of"),
])
def test_folder_with_wrong_config_is_refused(folder, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        import_folder(broken_copy(folder, tmp_path / "bad", edit_config=edit))


def test_folder_for_another_target_is_refused(folder, tmp_path):
    from conftest import make_target

    other = make_target(tmp_path / "other", layers=4)
    with pytest.raises(ConfigError, match="target of 6 layers, .* has 4"):
        load_drafter(folder, str(other))


def test_export_cli(checkpoint, tmp_path, capsys):
    main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "cli"), "--dtype", "bfloat16"])
    assert load_file(tmp_path / "cli" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "Lightning `.ckpt` file" in capsys.readouterr().out


# -- train/serve parity -------------------------------------------------------------------------------------------

# DFlash2 (docs/method.md section 10) at the tiny target's shape: 3 taps, groups of 16 channels, K = 4 of 60 tokens.
DFLASH2 = {"variant": "dflash2", "conv": ConvSettings(3, 16), "selector": SelectorSettings(8, 4)}
# what a DFlash2 folder built from DFLASH2 holds beside DFlash's dflash_config
DFLASH2_FIELDS = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def parity_drafter(target: Path, dtype: torch.dtype, **attention) -> DFlashDrafter:
    """A random drafter for the tiny target with non-trivial norms (and, for DFlash2, convolutions that are not the
    identity), attached to its embedding and head."""
    from transformers import AutoConfig

    cfg = DrafterConfig(num_layers=2, block_size=8, mask_token_id=52, **attention)
    cfg = cfg.resolved(AutoConfig.from_pretrained(target))
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg)
    for p in drafter.parameters():
        p.data += 0.1 * torch.randn_like(p)
    drafter.set_target_io(*load_target_io(str(target)))
    return drafter.to(dtype).eval()


# Tolerances on logits (|logits| <= ~0.5 here). float32: the paths differ by summation order only (observed
# 3e-7). bfloat16 (8-bit mantissa, one ulp is 0.004 at 0.5): the two paths round at different places (masked
# packed attention vs dense SDPA, RoPE tables cast before vs after), observed 0.007, allowed ~5 ulps.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=0.02, atol=0.02)}


# Sliding layers (docs/method.md 3b) with windows shorter than the documents: causal by default, or bidirectional.
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
SLIDING_BIDIR = {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 4, "is_causal": False}


YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        "max_position_embeddings": 512}  # as configs/qwen3-8b-long.yaml, scaled down


@pytest.mark.parametrize("dtype,attention", [
    (torch.float32, {}), (torch.bfloat16, {}), (torch.float32, SLIDING), (torch.float32, SLIDING_BIDIR),
    (torch.float32, {**SLIDING, **YARN}), (torch.float32, DFLASH2), (torch.bfloat16, DFLASH2),
    (torch.float32, {**SLIDING, **DFLASH2}),
])
def test_exported_folder_drafts_what_training_trained(tiny_target, tmp_path, dtype, attention):
    """AutoModel + the modelling file's forward, fed as engines feed it, equals DFlashDrafter.block_hidden; for
    DFlash2 the folder's selector drafts what ours does."""
    drafter = parity_drafter(tiny_target, dtype, **attention)
    folder = write_folder(drafter.config, drafter.state_dict(), tmp_path / "drafter")
    served, info = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=dtype, output_loading_info=True)
    served.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(served).__name__ == drafter.config.preset.architecture
    docs, starts = [13, 9, 20], [0, 13, 22]
    batch = packed_batch(docs, 48, vocab=50, seed=7)
    features = torch.randn(48, 2 * 64).to(dtype)
    anchors = torch.tensor([0, 6, 12, 13, 17, 21, 22, 35, 41])  # starts, middles and ends of the three documents
    same_drafts = 0
    same_picks = 0
    selector = copy.deepcopy(getattr(drafter, "candidate_selector", None))
    selector = selector.float() if selector is not None else None
    with torch.no_grad():
        trained_hidden = drafter.block_hidden(
            features, batch["input_ids"], batch["position_ids"], batch["doc_ids"], anchors,
            torch.ones(anchors.numel(), dtype=torch.bool),
        )
        trained = drafter.logits(trained_hidden)  # [A, B, V]
        for a, p in enumerate(anchors.tolist()):
            s = starts[int(batch["doc_ids"][p])]
            block = torch.full((1, 8), 52)
            block[0, 0] = batch["input_ids"][p]
            positions = torch.arange(0, p - s + 8)[None]  # the context's positions, then the block's
            hidden = served(position_ids=positions, noise_embedding=drafter.embed(block),
                            target_hidden=features[None, s:p])  # only the document's context before the anchor
            logits = drafter.logits(hidden[0])  # [B, V]
            torch.testing.assert_close(logits, trained[a], **TOLERANCE[dtype])
            same_drafts += int((logits[1:].argmax(-1) == trained[a, 1:].argmax(-1)).sum())
            if selector is not None:  # the selector's greedy path: the folder's against ours
                # ours in fp32: CandidateSelector.pair_scores feeds fp32 hidden states to the projection
                ours = selector.greedy(trained_hidden[a, 1:].float(), trained[a, 1:], block[0, 0])
                picks, _ = served.propose(hidden[0, 1:], logits[1:], int(block[0, 0]))
                same_picks += int((picks == ours).sum())
    # the draft tokens themselves: all equal in float32; bfloat16 may flip a near-tie
    n = 7 * anchors.numel()
    assert same_drafts == n if dtype == torch.float32 else same_drafts >= 0.9 * n
    if selector is not None:
        assert same_picks == n if dtype == torch.float32 else same_picks >= 0.8 * n


@pytest.mark.parametrize("variant", [{}, DFLASH2])
def test_exported_spec_generate_is_lossless(tiny_target, tmp_path, variant):
    """The folder's own `spec_generate` (the published usage) equals the target's greedy decoding."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = parity_drafter(tiny_target, torch.float32, **variant)
    served = AutoModel.from_pretrained(write_folder(drafter.config, drafter.state_dict(), tmp_path / "d"),
                                       trust_remote_code=True).eval()
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        ids = torch.randint(4, 40, (5 + 3 * i,), generator=g)
        out = served.spec_generate(target, ids[None], max_new_tokens=20, stop_token_ids=[2])
        assert out[0, ids.numel():].tolist() == target_generate(target, ids, 20, 2).tokens


@pytest.mark.parametrize("variant", [{}, DFLASH2])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=8)])
def test_exported_spec_generate_samples_as_the_decoder(tiny_target, tmp_path, sampling, variant):
    """Sampled `spec_generate` gives the project decoder's tokens for the same seed (both run the one verification
    rule of the modelling file, whose losslessness tests/test_speculative.py checks statistically); a DFlash2
    folder samples its drafts from the selector's q, as the decoder does."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = parity_drafter(tiny_target, torch.float32, **variant)
    served = AutoModel.from_pretrained(write_folder(drafter.config, drafter.state_dict(), tmp_path / "d"),
                                       trust_remote_code=True).eval()
    decoder = SpeculativeDecoder(target, drafter)
    g = torch.Generator().manual_seed(0)
    outputs = set()
    for seed in range(4):
        ids = torch.randint(4, 40, (5 + seed,), generator=g)
        out = served.spec_generate(target, ids[None], max_new_tokens=20, stop_token_ids=[2], **sampling,
                                   generator=torch.Generator().manual_seed(seed))
        ours = decoder.generate(ids, 20, 2, **sampling, generator=torch.Generator().manual_seed(seed))
        assert out[0, ids.numel():].tolist() == ours.tokens
        outputs.add(tuple(ours.tokens))
    assert len(outputs) == 4
    with pytest.raises(ValueError, match="top_p"):
        served.spec_generate(target, ids[None], max_new_tokens=4, temperature=1.0, top_p=1.5)


def test_sliding_window_drafter_round_trips_and_decodes_losslessly(tiny_target, tmp_path):
    """config.json carries the window as transformers and the engines read it; export -> import -> decode is
    the target's own greedy decoding, in our decoder (which drops K/V the window hides) and the folder's, and
    sampled decoding gives the same tokens in both for one seed."""
    from transformers import AutoConfig

    from dflash_lightning.decoding.speculative import SpeculativeDecoder

    drafter = parity_drafter(tiny_target, torch.float32, **SLIDING)
    folder = write_folder(drafter.config, drafter.state_dict(), tmp_path / "sliding")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["layer_types"] == SLIDING["layer_types"] and raw["sliding_window"] == 6
    assert raw["use_sliding_window"] is True and "is_causal" not in raw  # the reference's default: causal
    read = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert read.sliding_window == 6 and read.layer_types == SLIDING["layer_types"]
    cfg, _ = import_folder(folder)
    assert cfg.to_dict() == drafter.config.to_dict()
    bidir = write_folder(replace(cfg, is_causal=False), drafter.state_dict(), tmp_path / "bidir")
    assert json.loads((bidir / "config.json").read_text())["is_causal"] is False
    assert import_folder(bidir)[0].is_causal is False

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    decoder = SpeculativeDecoder(target, load_drafter(folder, str(tiny_target)))
    served = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        ids = torch.randint(4, 40, (4 + 5 * i,), generator=g)  # prompts shorter and longer than the window
        expected = target_generate(target, ids, 24, 2).tokens
        assert decoder.generate(ids, 24, 2).tokens == expected
        out = served.spec_generate(target, ids[None], max_new_tokens=24, stop_token_ids=[2])
        assert out[0, ids.numel():].tolist() == expected
        # Sampled (temperature 1): the folder and our decoder draft alike under the window, so one seed gives one
        # output; that the rule itself samples as the target alone is test_speculative_sampling_is_lossless.
        sampled = decoder.generate(ids, 24, 2, temperature=1.0, generator=torch.Generator().manual_seed(i))
        out = served.spec_generate(target, ids[None], max_new_tokens=24, stop_token_ids=[2], temperature=1.0,
                                   generator=torch.Generator().manual_seed(i))
        assert out[0, ids.numel():].tolist() == sampled.tokens


def test_folder_whose_window_transformers_would_drop_is_refused(tiny_target, tmp_path):
    drafter = parity_drafter(tiny_target, torch.float32, **SLIDING)
    folder = write_folder(drafter.config, drafter.state_dict(), tmp_path / "d")
    with pytest.raises(ConfigError, match="use_sliding_window is false"):
        import_folder(broken_copy(folder, tmp_path / "bad", edit_config=lambda c: c.update(use_sliding_window=False)))


# -- what the serving engines read ----------------------------------------------------------------------------------
# Written from vLLM's and SGLang's documented conventions for DFlash drafters (docs/method.md 7), not their code:
# both read config.json through transformers, the weights by name from the safetensors header; vLLM's block is
# 1 + num_speculative_tokens, SGLang's is block_size (--speculative-dflash-block-size); SGLang builds the drafter in
# config.json's dtype under --dtype auto (a float32 or missing one: float16), and both cast to an explicit --dtype.

ENGINE_FIELDS = {
    "architectures": list, "model_type": str, "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
    "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int, "rms_norm_eps": float,
    "rope_theta": float, "max_position_embeddings": int, "vocab_size": int, "attention_bias": bool,
    "hidden_act": str, "tie_word_embeddings": bool, "layer_types": list, "num_target_layers": int,
    "block_size": int, "dflash_config": dict, "dtype": str,
}
# Fields that would make an engine build another drafter: causal blocks, other feature layers, a mask token string
# checked against the tokenizer, a head or feature width of its own.
MISREAD = {"is_causal", "eagle_aux_hidden_state_layer_ids", "target_layer_ids", "mask_token", "draft_vocab_size",
           "target_hidden_size", "use_aux_hidden_state", "torch_dtype"}
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def engine_weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every weight an engine loads for this config.json, and its shape (no embedding, no head: the target's)."""
    H, inter, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv, K = c["num_attention_heads"] * D, c["num_key_value_heads"] * D, len(c["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (H, K * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
            p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        }
    return shapes


def safetensors_header(path: Path) -> dict[str, dict]:
    """Names, dtypes and shapes from a safetensors file's JSON header, as a loader reads them before any tensor."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def engine_dtype(config_dtype: str | None, requested: str = "auto") -> str:
    """The dtype SGLang builds the drafter in: --dtype auto takes config.json's, a float32 or missing one as float16."""
    if requested != "auto":
        return requested
    return "float16" if config_dtype in (None, "float32") else config_dtype


def check_engine_config(c: dict) -> None:
    """config.json has every field the engines read, with its type, and none they would misread."""
    for field, kind in ENGINE_FIELDS.items():
        assert type(c.get(field)) is kind, f"{field}: {c.get(field)!r} is not {kind.__name__}"
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3" and c["hidden_act"] == "silu"
    assert c["rope_scaling"] is None or isinstance(c["rope_scaling"], dict)
    assert c["layer_types"] == ["full_attention"] * c["num_hidden_layers"] and c["tie_word_embeddings"] is False
    assert c["dtype"] in ("bfloat16", "float16", "float32")
    d = c["dflash_config"]
    assert set(d) == {"mask_token_id", "target_layer_ids"}
    assert type(d["mask_token_id"]) is int and 0 <= d["mask_token_id"] < c["vocab_size"]
    ids = d["target_layer_ids"]
    assert ids and all(type(i) is int and 0 <= i < c["num_target_layers"] - 1 for i in ids)  # never the last layer
    assert not MISREAD & set(c), MISREAD & set(c)
    assert c["num_attention_heads"] % c["num_key_value_heads"] == 0


def check_serve_commands(printed: str, folder: Path, c: dict, target: str) -> None:
    """The commands export printed serve this folder for its target with the trained block size."""
    lines = [line.strip() for line in printed.splitlines()]
    vllm = shlex.split(next(line for line in lines if line.startswith("vllm serve")))
    assert vllm[2] == target
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(folder), "num_speculative_tokens": c["block_size"] - 1}
    sglang = shlex.split(next(line for line in lines if line.startswith("python -m sglang.launch_server")))
    flags = dict(zip(sglang[3::2], sglang[4::2], strict=True))
    assert flags == {"--model-path": target, "--speculative-algorithm": "DFLASH",
                     "--speculative-draft-model-path": str(folder),
                     "--speculative-dflash-block-size": str(c["block_size"])}


def test_engines_read_the_exported_folder(checkpoint, tiny_target, tmp_path, capsys):
    """Both the default (trained-dtype) export and a --dtype bfloat16 one: fields, weights, dtypes, commands."""
    for dtype, expected in ((None, "float32"), ("bfloat16", "bfloat16")):
        out = tmp_path / f"drafter-{expected}"
        main(["--checkpoint", str(checkpoint), "--out", str(out)] + (["--dtype", dtype] if dtype else []))
        c = json.loads((out / "config.json").read_text())
        check_engine_config(c)
        assert c["dtype"] == expected and c["block_size"] == 8  # the tiny checkpoint trains at 32-true, B = 8
        header = safetensors_header(out / "model.safetensors")
        assert {k: tuple(v["shape"]) for k, v in header.items()} == engine_weight_shapes(c)
        assert {SAFETENSORS_DTYPES[v["dtype"]] for v in header.values()} == {c["dtype"]}
        check_serve_commands(capsys.readouterr().out, out, c, str(tiny_target))
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(out)  # what both engines parse config.json into
        assert hf.dtype == getattr(torch, expected) and hf.block_size == 8 and hf.dflash_config["mask_token_id"] == 52
    assert engine_dtype(c["dtype"]) == "bfloat16"  # SGLang's --dtype auto builds the bf16 folder in bf16


def test_bf16_folder_loaded_in_float16_is_cast_or_refused(tiny_target, folder, tmp_path):
    """An explicit float16 serve of a bf16 folder casts the weights, as the engines do; a value past float16's
    range is refused by name instead of becoming inf."""
    cfg, state = import_folder(folder)
    bf16 = import_folder(write_folder(cfg, state, tmp_path / "bf16", "bfloat16"))[1]
    drafter = build_drafter(cfg, bf16, str(tiny_target), "float16")
    for k, v in drafter.state_dict().items():
        assert v.dtype == torch.float16 and torch.equal(v, bf16[k].to(torch.float16)), k
    assert drafter.head_weight.dtype == torch.float16
    served = AutoModel.from_pretrained(tmp_path / "bf16", trust_remote_code=True, dtype=torch.float16)
    assert served.fc.weight.dtype == torch.float16
    big = {**bf16, "norm.weight": bf16["norm.weight"].clone().fill_(1e5)}
    with pytest.raises(ValueError, match=r"'norm\.weight' holds values up to 9\.984e\+04, past the range of float16"):
        build_drafter(cfg, big, str(tiny_target), "float16")
    with pytest.raises(ValueError, match=r"'norm\.weight' .* past the range of float16"):
        write_folder(cfg, big, tmp_path / "f16", "float16")


def test_export_takes_the_training_dtype(checkpoint, tmp_path, capsys):
    """No --dtype: the dtype the drafter was trained in (bf16-mixed keeps fp32 masters; it is served in bf16)."""
    ckpt = torch.load(checkpoint, weights_only=False)
    assert ckpt["precision"] == "32-true"
    ckpt["precision"] = "bf16-mixed"
    torch.save(ckpt, tmp_path / "mixed.ckpt")
    out = export_checkpoint(tmp_path / "mixed.ckpt", tmp_path / "mixed")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(out / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    del ckpt["precision"]  # a checkpoint from before precision was recorded: as stored
    torch.save(ckpt, tmp_path / "old.ckpt")
    out = export_checkpoint(tmp_path / "old.ckpt", tmp_path / "old")
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def recipe_drafter(config_file: str, target_config, **resolve) -> DrafterConfig:
    """The drafter of a shipped GPU recipe, resolved against a target config of the real model's shape."""
    import yaml

    section = yaml.safe_load((Path(__file__).parents[1] / "configs" / config_file).read_text())["model"]["drafter"]
    return DrafterConfig(**section).resolved(target_config, **resolve)


def test_recipe_shaped_configs_serve_with_their_block_size(tmp_path, capsys):
    """Qwen3-8B (B = 16) and Llama-3.1-8B (B = 10) shapes, config only: fields, weight shapes, serve commands."""
    from transformers import LlamaConfig, Qwen3Config

    qwen3 = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
    llama = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        rope_theta=5e5, rope_scaling=llama3_rope)
    cases = [
        ("qwen3-8b.yaml", qwen3, dict(tokenizer_len=151669), "Qwen/Qwen3-8B", [1, 9, 17, 25, 33], 151669),
        ("llama3.1-8b.yaml", llama, dict(tokenizer_len=128256, mask_ids=[128002]),
         "meta-llama/Llama-3.1-8B-Instruct", [1, 8, 15, 22, 29], 128002),
    ]
    for config_file, target_config, resolve, target, ids, mask in cases:
        cfg = recipe_drafter(config_file, target_config, **resolve)
        out = write_config(cfg, tmp_path / config_file.removesuffix(".yaml"), "bfloat16")
        print_serve_commands(out, cfg, target, "bfloat16")
        c = json.loads((out / "config.json").read_text())
        check_engine_config(c)
        assert c["dflash_config"] == {"mask_token_id": mask, "target_layer_ids": ids} and c["dtype"] == "bfloat16"
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).state_dict().items()}
        assert shapes == engine_weight_shapes(c)
        check_serve_commands(capsys.readouterr().out, out, c, target)
    assert c["block_size"] == 10 and c["rope_scaling"]["rope_type"] == "llama3"  # vLLM: num_speculative_tokens 9


def test_last_target_layer_is_refused_by_export_and_evaluate(checkpoint, tmp_path):
    """A checkpoint whose drafter config names the target's last layer (L - 1 = 5) exports and evaluates nothing."""
    ckpt = torch.load(checkpoint, weights_only=False)
    ckpt["drafter_config"]["target_layer_ids"] = [1, 5]  # same shapes: only the feature differs
    torch.save(ckpt, tmp_path / "last.ckpt")
    for run in (lambda: main(["--checkpoint", str(tmp_path / "last.ckpt"), "--out", str(tmp_path / "x")]),
                lambda: load_drafter(tmp_path / "last.ckpt")):
        with pytest.raises(ConfigError, match=r"last\.ckpt: drafter_config: .*last layer \(5\): the engines disagree"):
            run()
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="last layer"):
        write_config(DrafterConfig(**ckpt["drafter_config"]), tmp_path / "y", "float32")
