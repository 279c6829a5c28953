"""The drafter against a plain one-block-at-a-time reference, the chunked loss against plain CE."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from helpers import packed_batch

from dflash_lightning.blocks import select_anchors, slot_weights
from dflash_lightning.config import DrafterConfig
from dflash_lightning.loss import LossSettings, chunked_head_loss
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.module import DFlashModule


def tiny_drafter(layers: int = 2, block: int = 4, seed: int = 0, **kw) -> DFlashDrafter:
    cfg = DrafterConfig(
        num_layers=layers, block_size=block, mask_token_id=3, target_layer_ids=[0, 2, 3], hidden_size=32,
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=256, vocab_size=40, num_target_layers=5, **kw,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).double()
    for p in drafter.parameters():  # non-trivial norms
        p.data += 0.1 * torch.randn_like(p)
    drafter.set_target_io(torch.randn(40, 32, dtype=torch.float64), torch.randn(40, 32, dtype=torch.float64))
    drafter.loss_settings = LossSettings(loss_weights="decay")  # the loss tests' references use the weights they pass
    return drafter


def rms(x, w, eps=1e-6):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block(drafter: DFlashDrafter, doc_features, doc_tokens, p: int) -> torch.Tensor:
    """One block, unpacked: its document's features before p, dense attention, written from docs/method.md."""
    cfg, sd = drafter.config, drafter.state_dict()
    B, H, nh, nkv, d = cfg.block_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    c = rms(doc_features[:p] @ sd["fc.weight"].T, sd["hidden_norm.weight"])  # [p, H]
    tokens = torch.tensor([int(doc_tokens[p])] + [cfg.mask_token_id] * (B - 1))
    x = drafter.embed_weight[tokens]  # [B, H]
    pos_ctx, pos_blk = torch.arange(p), torch.arange(p, p + B)
    for i in range(cfg.num_layers):
        w = {k[len(f"layers.{i}."):]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        q = rope(rms((h @ w["self_attn.q_proj.weight"].T).view(B, nh, d), w["self_attn.q_norm.weight"]), pos_blk)
        kv_in = torch.cat([c, h])  # context skips input_layernorm
        pos = torch.cat([pos_ctx, pos_blk])
        k = rope(rms((kv_in @ w["self_attn.k_proj.weight"].T).view(-1, nkv, d), w["self_attn.k_norm.weight"]), pos)
        v = (kv_in @ w["self_attn.v_proj.weight"].T).view(-1, nkv, d)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5  # all of context + whole block, unless sliding
        sliding = cfg.layer_types is not None and cfg.layer_types[i] == "sliding_attention"
        causal = sliding if cfg.is_causal is None else cfg.is_causal
        for slot in range(B):
            for m in range(p + B):  # key position m (context m < p, block slot m - p); query position p + slot
                hidden_by_window = sliding and abs(p + slot - m) >= cfg.sliding_window
                if hidden_by_window or (causal and m > p + slot):
                    scores[:, slot, m] = float("-inf")
        att = torch.softmax(scores, -1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(B, H) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        mlp = F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
        x = x + mlp @ w["mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"])


@pytest.mark.parametrize("attention", [
    {},
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},  # causal sliding, bidir full
    {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 3, "is_causal": False},
])
def test_drafter_matches_unpacked_reference(attention):
    drafter = tiny_drafter(**attention)
    docs = [13, 9, 20]
    batch = packed_batch(docs, 48, seed=3)
    features = torch.randn(48, 3 * 32, dtype=torch.float64)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 10, torch.Generator().manual_seed(0))
    hidden = drafter.block_hidden(features, batch["input_ids"], batch["position_ids"], batch["doc_ids"],
                                  anchors, valid)
    starts = [0, 13, 22]
    checked = 0
    for a in range(10):
        if not valid[a]:
            continue
        p = int(anchors[a])
        d = int(batch["doc_ids"][p])
        s, n = starts[d], docs[d]
        ref = reference_block(drafter, features[s:s + n], batch["input_ids"][s:s + n], p - s)
        torch.testing.assert_close(hidden[a], ref, rtol=1e-5, atol=1e-5)  # RoPE angles are fp32
        checked += 1
    assert checked == 10


def test_anchor_at_document_start_sees_no_context():
    drafter = tiny_drafter()
    batch = packed_batch([8, 8], 16, supervise_from=0)
    features = torch.randn(16, 96, dtype=torch.float64)
    anchors, valid = torch.tensor([8]), torch.tensor([True])
    hidden = drafter.block_hidden(features, batch["input_ids"], batch["position_ids"], batch["doc_ids"],
                                  anchors, valid)
    ref = reference_block(drafter, features[8:], batch["input_ids"][8:], 0)
    torch.testing.assert_close(hidden[0], ref, rtol=1e-5, atol=1e-5)


def test_chunked_loss_and_grad_match_plain_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,))
    weights = torch.rand(37, dtype=torch.float64) * (torch.rand(37) > 0.3)
    decay = LossSettings(loss_weights="decay")  # the weights given are the ones used
    total, ce, used, top, _ = chunked_head_loss(hidden, head, labels, weights, chunk=8, topk=5, settings=decay)
    loss = total / used.sum()
    (g,) = torch.autograd.grad(loss * 3, hidden)
    h2 = hidden.detach().clone().requires_grad_()
    logits = h2 @ head.T
    ref = (F.cross_entropy(logits, labels, reduction="none") * weights).sum() / weights.sum()
    (g2,) = torch.autograd.grad(ref * 3, h2)
    torch.testing.assert_close(loss.double(), ref)
    torch.testing.assert_close(ce, total)
    torch.testing.assert_close(g, g2)
    assert torch.equal(top, logits.topk(5, -1).indices)


def dense_objective(hidden, head, labels, weights, teacher_hidden, settings: LossSettings, block: int):
    """The objective of docs/method.md sections 4-4c on whole `[N, V]` logits, with autograd's own gradient."""
    logits = hidden @ head.T
    ce = F.cross_entropy(logits, labels, reduction="none")
    if settings.loss_weights == "dpace":  # section 4b, written out per block
        s = torch.where(weights > 0, (1 - settings.dpace_alpha) * torch.exp(-ce.detach()) + settings.dpace_alpha, 1.0)
        s = s.view(-1, block)
        m = (weights > 0).view(-1, block).double()
        w = torch.zeros_like(s)
        for k in range(block):
            for j in range(k, block):
                w[:, k] += m[:, k] * m[:, j] * s[:, 1:j + 1].prod(-1)
        weights = w.flatten()
    tau = settings.temperature
    p = torch.softmax(teacher_hidden @ head.T / tau, -1)
    kl = tau**2 * (p * (p.log() - torch.log_softmax(logits / tau, -1))).sum(-1)
    row = {"ce": ce, "kl": kl, "ce+kl": ce + kl}[settings.objective]
    return (row * weights).sum() / weights.sum(), (ce * weights).sum() / weights.sum(), weights


@pytest.mark.parametrize("settings", [
    LossSettings("ce", "dpace"), LossSettings("kl", "decay"), LossSettings("ce+kl", "decay", temperature=2.0),
    LossSettings("kl", "dpace", dpace_alpha=0.3, temperature=0.5),
])
@pytest.mark.parametrize("chunk", [4, 11, 1000])  # one block, not whole blocks (rounded down), everything at once
def test_objectives_chunked_match_the_dense_reference(settings, chunk):
    g = torch.Generator().manual_seed(0)
    block, n = 4, 36
    hidden = torch.randn(n, 16, dtype=torch.float64, generator=g).requires_grad_()
    head = torch.randn(50, 16, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 50, (n,), generator=g)
    weights = torch.rand(n, dtype=torch.float64, generator=g) * (torch.rand(n, generator=g) > 0.3)
    weights.view(-1, block)[:, 0] = 0
    final = torch.randn(40, 16, dtype=torch.float64, generator=g)  # the target's final hidden states
    rows = torch.randint(0, 40, (n,), generator=g)
    total, ce, used, _, _ = chunked_head_loss(hidden, head, labels, weights, chunk, 0, block, settings, final, rows)
    (grad,) = torch.autograd.grad(total / used.sum() * 3, hidden)
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref, ref_ce, ref_w = dense_objective(ref_hidden, head, labels, weights, final[rows], settings, block)
    (ref_grad,) = torch.autograd.grad(ref * 3, ref_hidden)
    torch.testing.assert_close(used, ref_w, rtol=1e-6, atol=1e-7)  # D-PACE weights are made in fp32
    torch.testing.assert_close(total / used.sum(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ce / used.sum(), ref_ce, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)


def test_training_forward_loss_and_weights():
    drafter = tiny_drafter(block=8)
    batch = packed_batch([30, 18], 64, seed=1)
    features = torch.randn(64, 96, dtype=torch.float64)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 12, torch.Generator().manual_seed(2))
    w = slot_weights(8, 4.0).double()
    out = drafter(features, batch["input_ids"], batch["position_ids"], batch["doc_ids"], batch["loss_mask"],
                  anchors, valid, w, topk=3)
    hidden = drafter.block_hidden(features, batch["input_ids"], batch["position_ids"], batch["doc_ids"],
                                  anchors, valid)
    ce = F.cross_entropy(drafter.logits(hidden).flatten(0, 1), out.labels.flatten(), reduction="none")
    torch.testing.assert_close(out.loss.double(), (ce * out.weights.flatten()).sum() / out.weights.sum())
    assert out.topk.shape == (12, 8, 3)
    out.loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())


def test_loss_settings_have_one_default():
    """The module, a bare drafter and the loss function default alike: CE with D-PACE weights, as README says."""
    params = inspect.signature(DFlashModule).parameters
    module = LossSettings(*(params[k].default for k in ("objective", "loss_weights", "dpace_alpha", "temperature")))
    bare = DFlashDrafter(tiny_drafter().config).loss_settings
    loss = inspect.signature(chunked_head_loss).parameters["settings"].default
    assert module == bare == loss == LossSettings("ce", "dpace", 0.5, 1.0)
