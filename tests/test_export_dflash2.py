"""DFlash2 folders (docs/method.md section 10): the config and key set the engines' and the reference's loaders read,
refusals of inconsistent folders, and the reference DFlash2DraftModel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_export import (
    DFLASH2,
    DFLASH2_FIELDS,
    SAFETENSORS_DTYPES,
    broken_copy,
    engine_weight_shapes,
    parity_drafter,
    safetensors_header,
)

from dflash_lightning.config import ConfigError
from dflash_lightning.folder.reader import import_folder
from dflash_lightning.folder.serve import serve_commands
from dflash_lightning.folder.writer import write_folder

# What each loader reads to build a DFlash2 drafter, read from (not copied out of) its source:
#  - vLLM 0.33.0 vllm/model_executor/models/registry.py: "DFlash2DraftModel" -> qwen3_dflash2.DFlash2Qwen3ForCausalLM;
#    vllm/transformers_utils/configs/eagle.py keeps an architecture that starts with "DFlash" under method "dflash";
#    vllm/v1/worker/gpu/spec_decode/__init__.py picks DFlash2Speculator when "DFlash2DraftModel" is the architecture.
#    qwen3_dflash2.py reads dflash_config["conv_kernel_size"], ["conv_group_size"], ["selector_rank"],
#    ["selector_top_k"] (KeyError if absent); its convolution's block is 1 + num_speculative_tokens. Parameters:
#    layers.{i}.{attention,mlp}_conv.base_kernel [2, k, H] (bare nn.Parameter), ...kernel_projection.weight
#    [2*k*H/g, H], candidate_selector.{predecessor,successor}_codebook [V, r] (bare nn.Parameter),
#    candidate_selector.hidden_projection.weight [r, H]; qwen3_dflash.py load_weights prefixes every name "model."
#    and the loader refuses names it has no parameter for.
#  - SGLang 0.5.23 sglang/srt/models/dflash.py: DFlash2DraftModel (in EntryClass, found by architecture name), its
#    DFlashGroupedConv and CandidateSelector hold the same names and shapes (bare nn.Parameter codebooks);
#    sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config reads the four fields from dflash_config only,
#    builds the convolutions only when conv_kernel_size is set there and the selector requires selector_rank;
#    load_weights skips names it does not know (so a missing one would stay zero: nothing warns).
#  - dflash 0.1.0 (z-lab) dflash/model.py: DFlash2DraftModel reads the four fields through dflash_config; its
#    codebooks are nn.Embedding, and its from_pretrained maps the bare checkpoint names
#    candidate_selector.{predecessor,successor}_codebook onto their `.weight`.
LOADER_DFLASH_CONFIG = {"mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size", "selector_rank",
                        "selector_top_k"}
LOADER_ARCHITECTURE = "DFlash2DraftModel"


def loader_weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every weight the DFlash2 loaders above build for this config.json: DFlash's plus section 10's."""
    d = c["dflash_config"]
    H, V, k, g, r = c["hidden_size"], c["vocab_size"], d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"]
    shapes = engine_weight_shapes(c)
    for i in range(c["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, H)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * (H // g), H)
    shapes |= {"candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),
               "candidate_selector.hidden_projection.weight": (r, H)}
    return shapes


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return parity_drafter(tiny_target, torch.float32, **DFLASH2)


@pytest.fixture(scope="module")
def folder(drafter, tmp_path_factory) -> Path:
    return write_folder(drafter.config, drafter.state_dict(), tmp_path_factory.mktemp("dflash2") / "drafter",
                        "bfloat16")


def test_folder_holds_what_the_dflash2_loaders_read(folder):
    c = json.loads((folder / "config.json").read_text())
    assert c["architectures"] == [LOADER_ARCHITECTURE]
    assert c["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert set(c["dflash_config"]) == LOADER_DFLASH_CONFIG
    assert {k: c["dflash_config"][k] for k in DFLASH2_FIELDS} == DFLASH2_FIELDS
    assert all(type(v) is int for k, v in c["dflash_config"].items() if k != "target_layer_ids")
    header = safetensors_header(folder / "model.safetensors")
    assert {k: tuple(v["shape"]) for k, v in header.items()} == loader_weight_shapes(c)  # none missing, none extra
    assert {SAFETENSORS_DTYPES[v["dtype"]] for v in header.values()} == {"bfloat16"}


def test_serve_commands_fit_a_dflash2_folder(drafter, folder):
    """The same method and flags serve it: vLLM picks DFlash2 by the architecture, and its convolution's block is
    1 + num_speculative_tokens, so that must be B - 1; SGLang's is the block size flag."""
    commands = serve_commands(folder, drafter.config, "T")
    spec = json.loads(commands["vllm"].split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "dflash", "model": str(folder), "num_speculative_tokens": 7}
    assert "--speculative-algorithm DFLASH " in commands["sglang"]
    assert commands["sglang"].endswith("--speculative-dflash-block-size 8")


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["dflash_config"].pop("selector_rank"), r"DFlash2DraftModel lacks dflash_config\.selector_rank"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]),
     r"DFlashDraftModel has field\(s\) dflash_config\.conv_kernel_size"),
    (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), r"architectures \['Qwen3ForCausalLM'\] is not one of"),
    (lambda c: c["dflash_config"].update(conv_group_size=7), r"conv_group_size \(7\) must divide hidden_size"),
    (lambda c: c["dflash_config"].update(selector_top_k="4"), r"dflash_config\.selector_top_k must be an integer"),
])
def test_inconsistent_dflash2_folder_is_refused(folder, tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message):
        import_folder(broken_copy(folder, tmp_path / "bad", edit_config=edit))


def test_dflash2_weights_in_a_dflash_folder_are_named(folder, tmp_path):
    """A DFlash2 folder whose config lost its DFlash2 fields and architecture: the extra keys are named."""
    def as_dflash(c: dict) -> None:
        c["architectures"] = ["DFlashDraftModel"]
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            c["dflash_config"].pop(k)

    with pytest.raises(ValueError, match=r"unexpected 'layers\.0\.attention_conv\.base_kernel' \[2, 3, 64\]"):
        import_folder(broken_copy(folder, tmp_path / "bad", edit_config=as_dflash))
