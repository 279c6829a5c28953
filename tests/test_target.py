"""Target features: packed rows give each document's own `hidden_states[j + 1]`; embedding and head."""

from __future__ import annotations

import pytest
import torch
from helpers import packed_batch
from transformers import AutoModelForCausalLM

from dflash_lightning.blocks import teacher_positions
from dflash_lightning.target_model import FeatureExtractor, load_target_io, packed_causal_mask, rank_devices


# sdpa: our dense device-side mask; eager: transformers' own; packed_flex: flex attention under our BlockMask
# (the GPU default, here through the eager CPU kernel), no [T, T] mask.
@pytest.mark.parametrize("attn", ["sdpa", "eager", "packed_flex"])
def test_features_of_packed_documents_equal_per_document_hidden_states(tiny_target, attn):
    layer_ids = [1, 3, 5]  # 5 is the last layer: HF numbering gives its normed output
    extractor = FeatureExtractor.from_pretrained(str(tiny_target), layer_ids, torch.float32, attn_implementation=attn)
    assert len(extractor.model.layers) == 6
    extractor2 = FeatureExtractor.from_pretrained(str(tiny_target), [0, 2], torch.float32)
    assert len(extractor2.model.layers) == 3  # nothing past max(ids) is built
    full = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    docs = [11, 7, 19]
    batch = packed_batch(docs, 48, vocab=50)
    feats = extractor(batch["input_ids"], batch["position_ids"])
    feats2 = extractor2(batch["input_ids"], batch["position_ids"])
    assert feats.shape == (48, 3 * 64)
    start = 0
    for n in docs:
        with torch.no_grad():
            hs = full(batch["input_ids"][None, start:start + n], output_hidden_states=True).hidden_states
        expected = torch.cat([hs[j + 1][0] for j in layer_ids], -1)
        torch.testing.assert_close(feats[start:start + n], expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats2[start:start + n], torch.cat([hs[1][0], hs[3][0]], -1), rtol=1e-4, atol=1e-4)
        start += n


def test_teacher_from_final_hidden_states_is_the_hf_targets_next_token_distribution(tiny_target):
    """softmax(head(final_hidden[p + k - 1])) of packed rows is the HF target's own distribution for slot k."""
    extractor = FeatureExtractor.from_pretrained(str(tiny_target), [0, 2], torch.float32, final_hidden=True)
    assert len(extractor.model.layers) == 6  # distillation runs the whole target
    plain = FeatureExtractor.from_pretrained(str(tiny_target), [0, 2], torch.float32)
    full = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    _, head = load_target_io(str(tiny_target))
    docs = [11, 7, 19]
    batch = packed_batch(docs, 48, vocab=50)
    fields = extractor.extract(batch["input_ids"], batch["position_ids"])
    torch.testing.assert_close(fields["context_features"], plain(batch["input_ids"], batch["position_ids"]))
    teacher = torch.softmax(fields["final_hidden"] @ head.T, -1)  # [T, V]
    start, expected = 0, []
    for n in docs:
        with torch.no_grad():
            logits = full(batch["input_ids"][None, start:start + n]).logits[0]
        expected.append(torch.softmax(logits, -1))
        start += n
    torch.testing.assert_close(teacher[:start], torch.cat(expected), rtol=1e-4, atol=1e-5)
    anchors = torch.tensor([12, 14])  # in the second document; slot k of anchor p is predicted from position p + k - 1
    rows = teacher_positions(anchors, 4, 48)
    for a, p in enumerate(anchors.tolist()):
        for k in range(1, 4):
            torch.testing.assert_close(teacher[rows[a, k]], expected[1][p + k - 1 - 11], rtol=1e-4, atol=1e-5)


def test_compiled_target_layers_give_the_eager_features_from_one_graph(tiny_target):
    """`compile_layers`: every decoder layer shares one compiled graph, new rows of the same length reuse it."""
    from torch._dynamo.utils import counters

    extractor = FeatureExtractor.from_pretrained(str(tiny_target), [1, 3, 5], torch.float32)
    rows = [packed_batch(docs, 48, vocab=50) for docs in ([11, 7, 19], [20, 28])]
    eager = [extractor(b["input_ids"], b["position_ids"]) for b in rows]
    torch._dynamo.reset()
    counters.clear()
    assert extractor.compile_layers() is extractor
    for batch, expected in zip(rows, eager, strict=True):
        torch.testing.assert_close(extractor(batch["input_ids"], batch["position_ids"]), expected)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and not counters["recompiles"]
    torch._dynamo.reset()


def test_target_features_compile_the_layers_they_load_when_asked(tiny_target):
    from dflash_lightning.target_model import TargetFeatures
    from dflash_lightning.target_model.loading import decoder_layers

    for compile in (False, True):
        extractor = TargetFeatures(str(tiny_target), "float32", compile=compile).load_extractor("cpu", [1, 3])
        compiled = [layer._compiled_call_impl is not None for layer in decoder_layers(extractor.model)]
        assert compiled == [compile] * 4


def test_target_compile_is_refused_off_cuda_and_when_sharded(tiny_target):
    from types import SimpleNamespace

    from dflash_lightning.config import ConfigError
    from dflash_lightning.target_model import TargetFeatures

    with pytest.raises(ConfigError, match="target.compile: not with placement 'sharded'"):
        TargetFeatures(str(tiny_target), placement="sharded", compile=True)
    trainer = SimpleNamespace(datamodule=None, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    module = object()
    callback = TargetFeatures(str(tiny_target), "float32", compile=True, layer_ids=[1])
    callback.load_extractor = lambda *a, **k: pytest.fail("the target loaded before the refusal")
    with pytest.raises(ConfigError, match="target.compile: compiles the target's layers on CUDA GPUs, .* on cpu"):
        callback.setup(trainer, module, "fit")
    separate = TargetFeatures(str(tiny_target), "float32", "separate", ["cpu"], compile=True, layer_ids=[1])
    with pytest.raises(ConfigError, match="target.compile: .* on cpu"):
        separate.setup(trainer, module, "fit")


def test_packed_causal_mask_matches_a_plain_reference():
    positions = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3, 0])
    doc = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    expected = torch.tensor([[doc[q] == doc[k] and k <= q for k in range(10)] for q in range(10)])
    assert torch.equal(packed_causal_mask(positions), expected)


@pytest.mark.parametrize("docs,total,tile", [([11, 7, 19], 48, 16), ([300, 41, 517, 90, 700], 2000, 128)])
def test_packed_causal_block_mask_is_the_dense_mask_in_tiles(docs, total, tile):
    """Its mask_mod is the dense mask element by element; its tiles are create_block_mask's of that mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    from dflash_lightning.target_model.features import packed_causal_block_mask

    positions = packed_batch(docs, total)["position_ids"]  # padding is one more document
    ours = packed_causal_block_mask(positions, tile)
    dense = packed_causal_mask(positions)
    assert torch.equal(create_mask(ours.mask_mod, None, None, total, total, device="cpu")[0, 0], dense)
    evaluated = create_block_mask(ours.mask_mod, None, None, total, total, device="cpu", BLOCK_SIZE=tile)
    for listed in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, listed), getattr(evaluated, listed)), listed
    for count, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        n = getattr(ours, count)[0, 0]
        for row in range(n.numel()):  # the same tiles in each query row (their order within a row is free)
            mine = set(getattr(ours, indices)[0, 0, row, : n[row]].tolist())
            assert mine == set(getattr(evaluated, indices)[0, 0, row, : n[row]].tolist()), (indices, row)
    assert ours.kv_num_blocks.sum() > 0 and (total < 128 or ours.full_kv_num_blocks.sum() > 0)  # long documents


def test_auto_attention_is_packed_flex_on_gpus_and_dense_on_the_cpu():
    from dflash_lightning.target_model.features import PACKED_FLEX, attention_for

    assert attention_for("auto", torch.device("cuda", 0)) == PACKED_FLEX
    assert attention_for("auto", torch.device("cpu")) == "sdpa"
    assert attention_for("eager", torch.device("cuda", 0)) == "eager"


def test_target_io_reads_embedding_and_head(tiny_target):
    full = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    embed, head = load_target_io(str(tiny_target))
    assert torch.equal(embed, full.get_input_embeddings().weight)
    assert torch.equal(head, full.lm_head.weight)


def test_target_devices_are_dealt_out_among_a_nodes_ranks():
    six = [f"cuda:{i}" for i in range(2, 8)]
    assert rank_devices(six, 0, 2) == ["cuda:2", "cuda:4", "cuda:6"]  # the seeds' 6 target / 2 trainer GPUs
    assert rank_devices(six, 1, 2) == ["cuda:3", "cuda:5", "cuda:7"]
    assert rank_devices(six, 0, 1) == six
    assert [rank_devices(["cuda:6", "cuda:7"], r, 4) for r in range(4)] == [["cuda:6"], ["cuda:7"]] * 2
    with pytest.raises(ValueError, match="target.target_devices: 5 devices .* 2 trainer ranks"):
        rank_devices(six[:5], 0, 2)


def test_sharded_placement_without_several_ranks_is_refused_naming_the_field(tiny_target):
    from types import SimpleNamespace

    from dflash_lightning.target_model import TargetFeatures

    trainer = SimpleNamespace(datamodule=None, num_nodes=1, num_devices=1,
                              strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with pytest.raises(ValueError, match="target.placement 'sharded' needs a distributed strategy"):
        TargetFeatures(str(tiny_target), "float32", "sharded", layer_ids=[1]).setup(trainer, object(), "fit")


def test_weight_map_reads_an_index_or_one_file_and_names_a_folder_without_weights(tiny_target, tmp_path):
    import json

    from safetensors.torch import save_file

    from dflash_lightning.target_model import weight_map

    one = weight_map(tiny_target)
    assert set(one.values()) == {"model.safetensors"} and "lm_head.weight" in one
    save_file({"a": torch.zeros(1)}, tmp_path / "part-1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "part-1.safetensors"}}))
    assert weight_map(tmp_path) == {"a": "part-1.safetensors"}
    with pytest.raises(FileNotFoundError, match=r"empty: no model\.safetensors or model\.safetensors\.index\.json"):
        weight_map(tmp_path / "empty")


def test_a_target_with_sliding_window_layers_is_refused():
    from transformers import AutoModel, Qwen3Config

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1)
    config = Qwen3Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    sliding = AutoModel.from_config(config)
    with pytest.raises(ValueError, match=r"target: layers \[1, 2\] are 'sliding_attention'"):
        FeatureExtractor(sliding, [1], 3)
    FeatureExtractor(AutoModel.from_config(Qwen3Config(**shape)), [1], 3)  # all full attention: accepted


def test_weights_fingerprint_reads_slices_of_every_weight_whatever_the_sharding(tiny_target, tmp_path):
    """A plain reference over safetensors' own reader; one file or two shards of the same weights agree; moving one
    weight a little (a fine-tune) changes it."""
    import hashlib
    import json
    import shutil

    from conftest import fine_tune
    from safetensors.torch import load_file, save_file

    from dflash_lightning.target_model.fingerprints import SLICE_BYTES, SLICES_PER_TENSOR, weights_fingerprint

    names = {torch.float32: "F32", torch.bfloat16: "BF16"}
    state = {k: v for f in sorted(tiny_target.glob("*.safetensors")) for k, v in load_file(f).items()}
    state["big"] = torch.arange(SLICES_PER_TENSOR * SLICE_BYTES, dtype=torch.float32)  # sliced, not whole
    digest = hashlib.sha256()
    for name in sorted(state):
        raw = state[name].contiguous().view(torch.uint8).numpy().tobytes()
        digest.update(json.dumps([name, names[state[name].dtype], list(state[name].shape)]).encode())
        if len(raw) <= SLICES_PER_TENSOR * SLICE_BYTES:
            digest.update(raw)
        else:
            step = (len(raw) - SLICE_BYTES) // (SLICES_PER_TENSOR - 1)
            digest.update(b"".join(raw[i * step:i * step + SLICE_BYTES] for i in range(SLICES_PER_TENSOR)))
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        shutil.copy(tiny_target / "config.json", folder)
    save_file(state, one / "model.safetensors")
    names_in_order = sorted(state)
    save_file({k: state[k] for k in names_in_order[::2]}, two / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in names_in_order[1::2]}, two / "model-00002-of-00002.safetensors")
    assert weights_fingerprint(str(one)) == weights_fingerprint(str(two)) == digest.hexdigest()
    tuned = fine_tune(one, tmp_path / "tuned")
    assert weights_fingerprint(str(tuned)) != digest.hexdigest()
