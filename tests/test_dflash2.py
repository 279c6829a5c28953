"""DFlash2's convolutions and candidate selector against plain references written from docs/method.md section 10."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import packed_batch
from test_model import tiny_drafter

from dflash_lightning.blocks import select_anchors, slot_weights
from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.loss import LossSettings, chunked_head_loss
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.convolutions import BlockConv, ConvSettings
from dflash_lightning.parts.selector import CandidateSelector, SelectorSettings
from dflash_lightning.parts.topk import unary_top_k


def conv_reference(x, d, base, g):
    """conv(x, d, b)[t, c] = sum_{tau <= t} (b[tau, c] + d[t, tau, c // g]) * x[t - tau, c], one block `x [B, H]`."""
    B, H = x.shape
    out = torch.zeros_like(x)
    for t in range(B):
        for c in range(H):
            for tau in range(base.shape[0]):
                if t - tau >= 0:
                    out[t, c] += (base[tau, c] + d[t, tau, c // g]) * x[t - tau, c]
    return out


def dflash2_config(kernel_size: int = 2, group_size: int = 8, rank: int = 6, top_k: int = 5, alpha: float = 1.0,
                   **kw) -> DrafterConfig:
    base = dict(
        num_layers=2, block_size=4, mask_token_id=3, target_layer_ids=[0, 2, 3], hidden_size=32,
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=256, vocab_size=40, num_target_layers=5, variant="dflash2",
        gamma=4.0, conv=ConvSettings(kernel_size, group_size), selector=SelectorSettings(rank, top_k, alpha),
    )
    return DrafterConfig(**{**base, **kw})


def random_conv(cfg: DrafterConfig, seed: int = 0) -> BlockConv:
    torch.manual_seed(seed)
    conv = BlockConv(cfg).double()
    for p in conv.parameters():
        p.data = torch.randn_like(p) * 0.3
    return conv


@pytest.mark.parametrize("k", [1, 2, 3])
def test_block_conv_matches_the_formula_per_block(k):
    cfg = dflash2_config(kernel_size=k)
    conv = random_conv(cfg)
    x = torch.randn(3 * cfg.block_size, cfg.hidden_size, dtype=torch.float64)  # 3 blocks
    inner = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False).double()
    out = conv(x, inner)
    d = conv.kernel_projection(x).view(3, cfg.block_size, 2, k, -1)
    for a in range(3):
        rows = slice(a * cfg.block_size, (a + 1) * cfg.block_size)
        mid = conv_reference(x[rows], d[a, :, 0], conv.base_kernel[0], cfg.conv.group_size)
        ref = conv_reference(inner(mid), d[a, :, 1], conv.base_kernel[1], cfg.conv.group_size)
        torch.testing.assert_close(out[rows], ref)


def test_block_conv_never_reads_another_block_and_is_causal():
    cfg = dflash2_config(kernel_size=3)
    conv = random_conv(cfg)
    x = torch.randn(2 * cfg.block_size, cfg.hidden_size, dtype=torch.float64)
    out = conv(x, torch.tanh)
    y = x.clone()
    y[: cfg.block_size] += 1.0  # the first block changes: the second must not
    y[cfg.block_size + 2:] += 1.0  # slots 2.. of the second block change: its slots 0, 1 must not
    out2 = conv(y, torch.tanh)
    torch.testing.assert_close(out2[cfg.block_size: cfg.block_size + 2], out[cfg.block_size: cfg.block_size + 2])
    assert not torch.allclose(out2[cfg.block_size + 2:], out[cfg.block_size + 2:])


def test_block_conv_is_the_identity_at_initialisation():
    cfg = dflash2_config(kernel_size=2)
    conv = BlockConv(cfg).double()
    x = torch.randn(2 * cfg.block_size, cfg.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(conv(x, torch.tanh), torch.tanh(x))


def test_variant_settings_are_checked():
    with pytest.raises(ConfigError, match="conv.group_size"):
        dflash2_config(group_size=5).check()
    with pytest.raises(ConfigError, match="selector.top_k"):
        dflash2_config(top_k=41).check()
    with pytest.raises(ConfigError, match="conv.kernel_size"):
        dflash2_config(kernel_size=5).check()
    with pytest.raises(ConfigError, match="selector.loss_weight"):
        dflash2_config(alpha=-1.0).check()


def dense_selector_loss(hidden, head, labels, weights, prev, selector: CandidateSelector, alpha: float):
    """CE + alpha * selector CE on whole `[N, V]` logits with autograd, written from docs/method.md section 10."""
    logits = hidden @ head.T  # [N, V]
    ce = F.cross_entropy(logits, labels, reduction="none")
    cand = logits.detach().topk(selector.top_k, -1).indices
    absent = ~(cand == labels[:, None]).any(-1)
    cand[absent, -1] = labels[absent]
    target = (cand == labels[:, None]).int().argmax(-1)
    P, S, W = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    score = logits.gather(1, cand) + ((P[prev] * (hidden @ W.T))[:, None, :] * S[cand]).sum(-1)
    sel = F.cross_entropy(score, target, reduction="none")
    return ((ce + alpha * sel) * weights).sum() / weights.sum(), (sel * weights).sum() / weights.sum(), ~absent


def random_selector(seed: int, alpha: float = 1.0) -> tuple[DrafterConfig, CandidateSelector]:
    """A selector for a 16-wide, 50-token head with weights far from their initialisation."""
    torch.manual_seed(seed)
    cfg = dflash2_config(hidden_size=16, vocab_size=50, top_k=6, rank=5, alpha=alpha)
    selector = CandidateSelector(cfg).double()
    for p in selector.parameters():
        p.data = torch.randn_like(p) * 0.5
    return cfg, selector


@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_selector_loss_and_gradients_match_a_dense_reference(alpha):
    cfg, selector = random_selector(seed=0, alpha=alpha)
    n = 8 * cfg.block_size
    hidden = torch.randn(n, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 16, dtype=torch.float64)
    labels, prev = torch.randint(0, 50, (n,)), torch.randint(0, 50, (n,))
    weights = torch.rand(n, dtype=torch.float64) * (torch.rand(n) > 0.3)
    settings = LossSettings(loss_weights="decay")
    total, _, used, _, [(sel, (hits,))] = chunked_head_loss(
        hidden, head, labels, weights, chunk=3 * cfg.block_size, block_size=cfg.block_size, settings=settings,
        parts=((selector, (prev,)),),
    )
    params = [hidden, *selector.parameters()]
    grads = torch.autograd.grad(total / used.sum() * 2, params)
    ref, ref_sel, in_top = dense_selector_loss(hidden, head, labels, weights, prev, selector, alpha)
    ref_grads = torch.autograd.grad(ref * 2, params)
    torch.testing.assert_close(total / used.sum(), ref)
    torch.testing.assert_close(sel / used.sum(), ref_sel)
    assert torch.equal(hits[:, 0], in_top) and 0 < in_top.sum() < n  # both cases occur
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_a_dflash_folder_warm_starts_dflash2_with_the_same_forward(tmp_path):
    """The identity convolutions make a DFlash2 drafter started from DFlash weights compute the same block states."""
    from dataclasses import replace

    from dflash_lightning.folder.writer import write_folder
    from dflash_lightning.long_runs.warm_start import warm_start

    dflash = tiny_drafter(block=4, gamma=4.0)  # random weights, norms off 1
    write_folder(dflash.config, {k: v.float() for k, v in dflash.state_dict().items()}, tmp_path / "hf")
    cfg2 = replace(dflash.config, variant="dflash2", conv=ConvSettings(group_size=8), selector=SelectorSettings(6, 5))
    dflash2 = DFlashDrafter(cfg2).double()
    dflash2.set_target_io(dflash.embed_weight, dflash.head_weight)
    warm_start(dflash2, str(tmp_path / "hf"))
    batch = packed_batch([13, 9], 24, vocab=40, seed=1)
    features = torch.randn(24, 96, dtype=torch.float64)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 6, torch.Generator().manual_seed(0))
    args = (features, batch["input_ids"], batch["position_ids"], batch["doc_ids"], anchors, valid)
    # the folder holds fp32 weights of the fp64 drafter: equal to fp32 rounding, where any tap off identity is O(1)
    torch.testing.assert_close(dflash2.block_hidden(*args), dflash.block_hidden(*args), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="num_layers"):
        warm_start(DFlashDrafter(replace(cfg2, num_layers=1)), str(tmp_path / "hf"))


def test_selector_greedy_path_matches_a_plain_reference():
    torch.manual_seed(1)
    cfg = dflash2_config(top_k=4)
    selector = CandidateSelector(cfg).double()
    for p in selector.parameters():
        p.data = torch.randn_like(p)
    hidden, logits = torch.randn(5, 32, dtype=torch.float64), torch.randn(5, 40, dtype=torch.float64)
    picks = selector.greedy(hidden, logits, torch.tensor(7))
    P, S, W = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    prev = 7
    for i in range(5):
        cand = sorted(range(40), key=lambda c: -float(logits[i, c]))[:4]
        scores = [float(logits[i, c] + sum(P[prev, r] * (W[r] @ hidden[i]) * S[c, r] for r in range(6)))
                  for c in cand]
        prev = cand[max(range(4), key=lambda j: scores[j])]
        assert int(picks[i]) == prev, f"slot {i + 1}"


def test_dflash2_training_step_through_the_module_logs_selector_metrics():
    """The module's step trains the selector: its loss, recall and teacher-forced accuracy come out of one forward."""
    drafter = DFlashDrafter(dflash2_config()).double()
    drafter.set_target_io(torch.randn(40, 32, dtype=torch.float64), torch.randn(40, 32, dtype=torch.float64))
    batch = packed_batch([13, 9], 24, vocab=40, seed=1)
    features = torch.randn(24, 96, dtype=torch.float64)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 6, torch.Generator().manual_seed(0))
    out = drafter(features, batch["input_ids"], batch["position_ids"], batch["doc_ids"], batch["loss_mask"],
                  anchors, valid, slot_weights(4, 4.0).double(), topk=5)
    out.loss.backward()
    assert drafter.candidate_selector.successor_codebook.grad.abs().sum() > 0
    assert drafter.layers[0].mlp_conv.kernel_projection.weight.grad.abs().sum() > 0
    metrics = CandidateSelector.metric(4)
    metrics.update(out.parts["selector"].rows, out.labels, out.supervised)
    values = metrics.compute()
    assert 0 < float(values["selector/recall"]) <= 1 and float(values["selector/tau"]) >= 1
    assert float(out.parts["selector"].logs["selector/loss"]) > 0


@pytest.mark.parametrize(("settings", "alpha"), [(LossSettings("kl", "dpace", dpace_alpha=0.3, temperature=0.5), 0.7),
                                               (LossSettings("ce+kl", "dpace"), 1.0)])
def test_selector_term_beside_distillation_and_dpace_matches_the_dense_reference(settings, alpha):
    """With KL (or CE + KL) and D-PACE the selector adds alpha * its CE, weighted by the unary D-PACE weights."""
    from test_model import dense_objective

    cfg, selector = random_selector(seed=2, alpha=alpha)
    block, n = cfg.block_size, 9 * cfg.block_size
    hidden = torch.randn(n, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 16, dtype=torch.float64)
    labels, prev = torch.randint(0, 50, (n,)), torch.randint(0, 50, (n,))
    weights = torch.rand(n, dtype=torch.float64) * (torch.rand(n) > 0.3)
    weights.view(-1, block)[:, 0] = 0
    final, rows = torch.randn(40, 16, dtype=torch.float64), torch.randint(0, 40, (n,))
    total, _, used, _, _ = chunked_head_loss(hidden, head, labels, weights, 2 * block, 0, block, settings, final,
                                             rows, parts=((selector, (prev,)),))
    params = [hidden, *selector.parameters()]
    grads = torch.autograd.grad(total / used.sum(), params)
    unary, _, w = dense_objective(hidden, head, labels, weights, final[rows], settings, block)
    _, sel, _ = dense_selector_loss(hidden, head, labels, w.detach(), prev, selector, 0.0)
    ref = unary + alpha * sel
    torch.testing.assert_close(total / used.sum(), ref)
    for g, r in zip(grads, torch.autograd.grad(ref, params), strict=True):
        torch.testing.assert_close(g, r)


def test_warm_start_refuses_a_selector_of_another_rank_naming_the_field(tmp_path):
    from dataclasses import replace

    from dflash_lightning.folder.writer import write_folder
    from dflash_lightning.long_runs.warm_start import warm_start

    source = DFlashDrafter(dflash2_config())
    write_folder(source.config, source.state_dict(), tmp_path / "hf")
    with pytest.raises(ConfigError, match="selector.rank"):
        warm_start(DFlashDrafter(replace(source.config, selector=SelectorSettings(rank=3, top_k=5))),
                   str(tmp_path / "hf"))


@pytest.mark.parametrize("v", [8 * 16 * 32, 8 * 16 * 32 + 19])  # whole groups only, and a tail past the last one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unary_top_k_is_torch_topk_in_two_passes(v, dtype):
    """The grouped top K returns torch.topk's ids in its order, wherever the largest entries sit (tail included)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(v, generator=g) for _ in range(6)]).float()  # distinct values per row
    rows[1] = torch.arange(v).float()  # the largest all in the tail
    rows[2] = -torch.arange(v).float()  # all in the first group
    rows[3, torch.arange(16) * 97] = v + torch.arange(16.0)  # one per group, spread out
    logits = (rows / v * 200).to(dtype) if dtype == torch.bfloat16 else rows
    if dtype == torch.bfloat16:  # bf16 rounding makes ties: compare values, which are what the ids select
        expected = logits.topk(16, dim=-1).values
        assert torch.equal(logits.gather(1, unary_top_k(logits, 16, group=32)), expected)
    else:
        assert torch.equal(unary_top_k(logits, 16, group=32), logits.topk(16, dim=-1).indices)
    assert torch.equal(unary_top_k(logits[:, :100], 16, group=32), logits[:, :100].topk(16, dim=-1).indices)
