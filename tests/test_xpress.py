"""XPress (docs/method.md section 14) against plain references written here: the refiner's math, the chunked loss
and every gradient against full tensors and autograd, the Jacobi passes against left-to-right decoding, the
sampled drafts against their q, the folder fields, the speculators converter, and vLLM 0.34's own refiner."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash_lightning.errors import ConfigError
from dflash_lightning.loss import LossSettings, chunked_head_loss
from dflash_lightning.parts.xpress import (
    PREFIX,
    SPECULATORS_NAMES,
    XPress,
    XPressHead,
    XPressMetrics,
    XPressSettings,
    folder_fields,
    from_speculators,
    jacobi_draft,
    settings_from_folder,
    token_before_anchor,
    weight_shapes,
)

V, H, B, R = 48, 24, 5, 6  # vocabulary, width, block, rank
SETTINGS = XPressSettings(rank=R, mlp_hidden=2 * R)


def random_head(seed: int = 0, settings: XPressSettings = SETTINGS, scale: float = 0.3) -> XPressHead:
    """A refiner in fp64 with every weight noise large enough to matter (the raw mixer's upper triangle too, which
    must stay unread)."""
    torch.manual_seed(seed)
    xhead = XPressHead(V, H, B, settings).double()
    for p in xhead.parameters():
        p.data.normal_(0, scale)
    return xhead


def plain_refined(xhead: XPressHead, hidden, prev, head):
    """Section 14 spelt out slot by slot: g = mean h, a_k = in_proj([down_h h_k; down_g g; w1 prev_k]), c_k = a_k +
    sum_{j<=k} L[:, k, j] a_j, x = c + down(silu(gate c) * up c), refined = head(h) + w2 x."""
    g = hidden.mean(1)
    a = [xhead.in_proj.weight @ torch.cat([xhead.down_h.weight @ hidden[:, k].T, xhead.down_g.weight @ g.T,
                                           xhead.w1.weight[prev[:, k]].T]) for k in range(hidden.shape[1])]
    out = []
    for k in range(hidden.shape[1]):
        c = a[k] + sum(xhead.mix.L[:, k, j, None] * a[j] for j in range(k + 1))  # [r, N]
        mlp = xhead.mlp.down_proj.weight @ (F.silu(xhead.mlp.gate_proj.weight @ c) * (xhead.mlp.up_proj.weight @ c))
        out.append(hidden[:, k] @ head.T + (xhead.w2.weight @ (c + mlp)).T)
    return torch.stack(out, 1)


# -- settings and the module ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [("rank", 0), ("rank", 8), ("rank", 48), ("mlp_hidden", 0),
                                              ("mlp_hidden", 96), ("num_passes", 0), ("topc", -1),
                                              ("topc", V + 1), ("consistency_rounds", -1), ("consistency_weight", -1.0),
                                              ("base_weight", -0.1), ("ce_weight", -1.0), ("tv_weight", -1.0),
                                              ("prev0", "before")])
def test_settings_refuse_a_bad_field_by_name(field, value):
    class Config:
        vocab_size, block_size = V, B

    with pytest.raises(ConfigError, match=f"xpress.{field} must"):
        XPressSettings(**{field: value}).check(Config)
    XPressSettings().check(Config)  # the defaults pass
    with pytest.raises(ConfigError, match="both 0"):
        XPressSettings(ce_weight=0.0, tv_weight=0.0).check(Config)


def test_weight_names_shapes_and_init_are_the_folders():
    """State-dict keys under `xpress_head.` are exactly section 14's (vLLM's load_weights names) with their shapes; a
    fresh refiner has a zero raw mixer (the identity mix) and normal(0, 0.02) weights."""
    torch.manual_seed(0)
    xhead = XPressHead(1000, 64, 16, XPressSettings(rank=32, mlp_hidden=64))
    state = {PREFIX + k: tuple(v.shape) for k, v in xhead.state_dict().items()}
    assert state == weight_shapes(XPressSettings(rank=32, mlp_hidden=64), 1000, 64, 16)
    assert set(state) == {PREFIX + n for n in ("w1.weight", "down_h.weight", "down_g.weight", "in_proj.weight", "mix.L",
                                               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                               "w2.weight")}
    assert not xhead.mix.L.any()
    for name, p in xhead.named_parameters():
        if name != "mix.L":
            assert abs(p.std().item() - 0.02) < 0.004, name


def test_refined_logits_against_the_slot_by_slot_formula():
    """The module's refined logits equal section 14 written slot by slot; the raw mixer's upper triangle is unread
    (a slot never sees a later one)."""
    xhead = random_head()
    head = torch.randn(V, H, dtype=torch.float64)
    hidden = torch.randn(3, B, H, dtype=torch.float64)
    prev = torch.randint(0, V, (3, B))
    torch.testing.assert_close(xhead(hidden, prev, head), plain_refined(xhead, hidden, prev, head))
    later = prev.clone()
    later[:, 3] = (later[:, 3] + 1) % V  # a token read at slot 3 changes slots >= 3 only
    diff = (xhead(hidden, later, head) - xhead(hidden, prev, head)).abs().amax((0, 2))
    assert (diff[:3] == 0).all() and (diff[3:] > 0).all()


# -- training --------------------------------------------------------------------------------------------------------
def plain_loss(xhead, settings, hidden, head, teacher, tokens, prev0, weights):
    """Section 14's loss with full tensors and autograd: L = C(tf) + cw mean_j C(round j) + bw C(head h), C = ce
    CE(., argmax P) + tv TV(softmax ., P), each sum w C / sum m over slots 1..B-1; round j reads [prev_0, x_p, the
    previous pass's argmax of slots 1..B-2], detached, the first from head(h)'s argmax."""
    s = settings
    base = hidden[:, 1:] @ head.T  # [A, B-1, V]
    p = torch.softmax(teacher @ head.T, -1)
    y = p.argmax(-1)
    w = weights[:, 1:]
    m = (w > 0).sum()

    def c_term(z):
        ce = F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").view_as(w)
        tv = 0.5 * (torch.softmax(z, -1) - p).abs().sum(-1)
        return (w * (s.ce_weight * ce + s.tv_weight * tv)).sum() / m

    def refined(prev):
        return plain_refined(xhead, hidden, prev, head)[:, 1:]

    tf = c_term(refined(torch.cat([prev0[:, None], tokens[:, :-1]], 1)))
    drafts = base.detach().argmax(-1)
    rounds = []
    for _ in range(s.consistency_rounds):
        z = refined(torch.cat([prev0[:, None], tokens[:, :1], drafts[:, :-1]], 1))
        rounds.append(c_term(z))
        drafts = z.detach().argmax(-1)
    loss = tf + s.base_weight * c_term(base)
    if rounds:
        loss = loss + s.consistency_weight * torch.stack(rounds).mean()
    return loss, torch.stack([tf, *rounds, c_term(base)]).detach()


def loss_case(seed: int = 0, a: int = 7):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(a, B, H, dtype=torch.float64, generator=gen)
    head = torch.randn(V, H, dtype=torch.float64, generator=gen)
    teacher = torch.randn(a, B - 1, H, dtype=torch.float64, generator=gen)
    tokens = torch.randint(0, V, (a, B), generator=gen)
    prev0 = torch.randint(0, V, (a,), generator=gen)
    k = torch.arange(B, dtype=torch.float64)
    m = torch.rand(a, B, generator=gen) > 0.25
    m[:, 0] = False
    m[-1] = False  # an invalid anchor
    weights = torch.where(k == 0, 0.0, torch.exp(-(k - 1) / 4)) * m
    return hidden, head, teacher, tokens, prev0, weights


def loop_loss(xhead, settings, hidden, head, teacher, tokens, prev0, weights, labels, chunk: int = 4096):
    """Section 14's loss through the real chunked head loop (`chunked_head_loss`) with the XPress part in it, its inputs
    as its `head_inputs` makes them: (the loss over the count of supervised slots, each term so, per-row results
    `[A, B-1, 8]`)."""
    part = XPress(SimpleNamespace(xpress=settings, vocab_size=V, hidden_size=H, block_size=B, loss_gamma=4.0))
    part.head = xhead
    a = hidden.shape[0]
    inputs = (xhead.hidden_cache(hidden), tokens, prev0, teacher.flatten(0, 1))
    total, _, _, _, [(_, rows)] = chunked_head_loss(
        hidden[:, 1:].flatten(0, 1), head, labels[:, 1:].flatten(), weights[:, 1:].flatten(), chunk, 0, B - 1,
        LossSettings(loss_weights="decay"), parts=((part, inputs),))
    rows = rows[0].view(a, B - 1, -1)
    m = (weights[:, 1:] > 0).sum()
    return total / m, (weights[:, 1:, None] * rows[..., 5:]).sum((0, 1)) / m, rows


@pytest.mark.parametrize(("settings", "chunk"), [
    (SETTINGS, B - 1),  # one block a chunk
    (SETTINGS, 3 * (B - 1) + 2),  # three blocks a chunk, a short last chunk
    (XPressSettings(rank=R, mlp_hidden=8, consistency_rounds=0, base_weight=0.0, ce_weight=0.4, tv_weight=0.0),
     4096),
    (XPressSettings(rank=R, mlp_hidden=8, consistency_rounds=2, consistency_weight=1.0, ce_weight=0.0), 2 * (B - 1)),
])
def test_chunked_loss_and_every_gradient_equal_the_plain_reference(settings, chunk):
    """Section 14's loss in the chunked head loop (hand-made gradients, a few [rows, V] tensors of one chunk of whole
    blocks at once) equals the full-tensor autograd reference: the loss, each term, and the gradients of the hidden
    states (every slot, slot 0 through g and the mix) and of every refiner weight."""
    xhead = random_head(1, settings)
    hidden, head, teacher, tokens, prev0, weights = loss_case()
    ref_h = hidden.clone().requires_grad_()
    ref, ref_terms = plain_loss(xhead, settings, ref_h, head, teacher, tokens, prev0, weights)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in xhead.named_parameters()}
    xhead.zero_grad()
    h = hidden.clone().requires_grad_()
    loss, terms, rows = loop_loss(xhead, settings, h, head, teacher, tokens, prev0, weights, tokens, chunk)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    rounds = ref_terms[1:-1].mean() if settings.consistency_rounds else torch.zeros((), dtype=ref.dtype)
    torch.testing.assert_close(terms, torch.stack([ref_terms[0], rounds, ref_terms[-1]]))
    torch.testing.assert_close(h.grad, ref_h.grad)
    assert h.grad[:, 0].abs().sum() > 0  # slot 0 reaches the loss through g and the mix
    for name, p in xhead.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], msg=name)
    assert rows.shape == (7, B - 1, 8)


def test_loss_rows_are_the_acceptances_and_argmax_hits():
    """Per row: 1 - TV of the tf pass and of the base logits, and whether the tf, last round and base argmax hit the
    data label."""
    xhead = random_head(2)
    hidden, head, teacher, tokens, prev0, weights = loss_case(3)
    labels = torch.randint(0, V, tokens.shape)
    base = hidden[:, 1:] @ head.T
    labels[:, 1:][:, ::2] = base.argmax(-1)[:, ::2]  # some hits
    _, _, rows = loop_loss(xhead, SETTINGS, hidden, head, teacher, tokens, prev0, weights, labels)
    p = torch.softmax(teacher @ head.T, -1)
    torch.testing.assert_close(rows[..., 1], torch.minimum(torch.softmax(base, -1), p).sum(-1))
    tf = plain_refined(xhead, hidden, torch.cat([prev0[:, None], tokens[:, :-1]], 1), head)[:, 1:]
    torch.testing.assert_close(rows[..., 0], torch.minimum(torch.softmax(tf, -1), p).sum(-1))
    assert torch.equal(rows[..., 2].bool(), tf.argmax(-1) == labels[:, 1:])
    assert torch.equal(rows[..., 4].bool(), base.argmax(-1) == labels[:, 1:])


def test_metrics_against_a_plain_loop():
    """Per-slot acceptances and their tau, and the accepted prefixes of the three argmax hits, counted by hand."""
    gen = torch.Generator().manual_seed(12)
    rows = torch.rand(6, B - 1, 5, generator=gen)
    rows[..., 2:] = (rows[..., 2:] > 0.3).float()
    supervised = torch.rand(6, B, generator=gen) > 0.2
    supervised[:, 0] = False
    metric = XPressMetrics(B)
    metric.update(rows[:3], None, supervised[:3])
    metric.update(rows[3:], None, supervised[3:])
    out = metric.compute()
    m = supervised[:, 1:].float()
    accept = [(rows[:, k, 0] * m[:, k]).sum() / m[:, k].sum() for k in range(B - 1)]
    tau = 1.0
    for k in range(B - 1):
        tau += float(torch.stack(accept[: k + 1]).prod())
    torch.testing.assert_close(out["xpress/tau_tv"], torch.tensor(tau))
    torch.testing.assert_close(out["xpress/accept/slot_01"], accept[0])
    for col, name in ((2, "tau_greedy"), (3, "tau_rounds"), (4, "base_tau_greedy")):
        blocks = accepted = 0
        for a in range(6):
            if supervised[a, 1]:
                blocks += 1
                for k in range(B - 1):
                    if not (supervised[a, k + 1] and rows[a, k, col]):
                        break
                    accepted += 1
        torch.testing.assert_close(out[f"xpress/{name}"], torch.tensor(1 + accepted / blocks))


def test_head_loop_with_xpress_compiles_once_without_host_syncs():
    """The chunked head loop with the XPress part in it, as `model.compile` compiles it (`compile_blocks`): one graph
    for two batches of other hidden states, tokens, prev_0, weights and teachers (no recompile, no graph break), no
    `.item()` / `.tolist()` in it, and the eager loss and gradients. Traced only (a recording backend): inductor's
    code generation of the unrolled passes takes minutes on two CPU cores (docs/xpress.md)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    xhead = random_head(3).float()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    part = XPress(SimpleNamespace(xpress=SETTINGS, vocab_size=V, hidden_size=H, block_size=B, loss_gamma=4.0))
    part.head = xhead
    compiled = torch.compile(chunked_head_loss, backend=backend, fullgraph=True, dynamic=False)
    counters.clear()
    for seed in (1, 2):
        hidden, head, teacher, tokens, prev0, weights = (t.float() if t.is_floating_point() else t
                                                         for t in loss_case(seed, a=4))
        grads = []
        for fn in (compiled, chunked_head_loss):
            h = hidden.clone().requires_grad_()
            inputs = (xhead.hidden_cache(h), tokens, prev0, teacher.flatten(0, 1))
            total, *_ = fn(h[:, 1:].flatten(0, 1), head, tokens[:, 1:].flatten(), weights[:, 1:].flatten(),
                           2 * (B - 1), 3, B - 1, LossSettings(loss_weights="decay"), parts=((part, inputs),))
            total.backward()
            grads.append((total.detach(), h.grad, xhead.mix.L.grad.clone()))
            xhead.zero_grad()
        for ours, ref in zip(*grads, strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1 and not counters["recompiles"] and not counters["graph_break"]
    sync_ops = ("item", "tolist", torch.ops.aten._local_scalar_dense.default)
    assert not [node for node in graphs[0].graph.nodes if node.target in sync_ops]


def xpress_module(tiny_target, compile: bool = False, fp8: str = "none", **settings):
    """A two-layer XPress module on the tiny target (width 64), section 14's loss settings."""
    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.module import DFlashModule

    cfg = DrafterConfig(num_layers=2, block_size=B, variant="xpress",
                        xpress=XPressSettings(rank=16, mlp_hidden=64, **settings))
    module = DFlashModule(str(tiny_target), cfg, token_budget=64, num_anchors=8, objective="ce",
                          loss_weights="decay", compile=compile, fp8=fp8)
    module.configure_model()
    return module


@pytest.fixture(scope="module")
def xpress_batch(tiny_target):
    from test_module import batch_with_features

    module = xpress_module(tiny_target)
    batch = batch_with_features(tiny_target, module.drafter_config.target_layer_ids)
    batch["final_hidden"] = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    return batch


@pytest.mark.parametrize("prev0", ["previous", "anchor"])
def test_module_step_is_the_plain_loss(tiny_target, xpress_batch, prev0):
    """The real training step (`DFlashModule.step`: anchors, blocks, labels, teacher rows, prev_0, slot weights, the
    denominator, the head loop beside it) gives section 14's loss of the plain reference on the same blocks, and the
    same gradients of the backbone and of the refiner; the loop's own CE adds nothing (weight 0)."""
    from dflash_lightning.blocks import block_labels, select_anchors, teacher_positions

    module = xpress_module(tiny_target, prev0=prev0)
    drafter, buf = module.drafter, module.buffers_
    for p in drafter.parts[0].head.parameters():  # off the refiner's zero mixer and small init
        p.data.normal_(0, 0.3)
    out = module.step(xpress_batch, topk=5, generator=torch.Generator().manual_seed(3))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    anchors, valid = select_anchors(buf.loss_mask, buf.doc_ids, 8, torch.Generator().manual_seed(3))
    hidden = drafter.block_hidden(buf.features, buf.input_ids, buf.position_ids, buf.doc_ids, anchors, valid)
    labels, weights = block_labels(buf.input_ids, buf.loss_mask, buf.doc_ids, anchors, valid, buf.slot_weights)
    assert buf.slot_weights.tolist() == pytest.approx([0.0] + [math.exp(-k / 4) for k in range(B - 1)])
    teacher = buf.final_hidden[teacher_positions(anchors, B, 64)[:, 1:]]
    first = labels[:, 0] if prev0 == "anchor" else token_before_anchor(buf.input_ids, buf.doc_ids, anchors)
    settings = drafter.config.xpress
    ref, terms = plain_loss(drafter.parts[0].head, settings, hidden, drafter.head_weight, teacher, labels, first,
                            weights)
    ref.backward()
    torch.testing.assert_close(out.loss, ref)
    logs = out.parts["xpress"].logs
    torch.testing.assert_close(torch.stack([logs[f"xpress/loss_{k}"] for k in ("tf", "rounds", "base")]),
                               torch.stack([terms[0], terms[1:-1].mean(), terms[-1]]))
    assert out.parts["xpress"].rows.shape == (8, B - 1, 8)
    for name, p in drafter.named_parameters():  # fp32: to 1e-5 of each gradient's largest entry
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()), msg=name)
    assert grads["xpress_head.mix.L"].abs().sum() > 0 and grads["fc.weight"].abs().sum() > 0


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_steps_follow_the_fp32_step(tiny_target, xpress_batch, precision):
    """bf16 compute over fp32 weights (autocast, as bf16-mixed runs) and bf16 weights: the refiner's hand-made sums
    and its weights' gradient accumulators stay fp32 (autocast off inside the chunk), the loss stays within 3% of the
    fp32 step's, every gradient is finite and of its weight's dtype."""
    module = xpress_module(tiny_target)
    reference = module.step(xpress_batch, generator=torch.Generator().manual_seed(3)).loss.detach()
    if precision == "bf16-true":
        module = module.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        out = module.step(xpress_batch, generator=torch.Generator().manual_seed(3))
    out.loss.backward()
    torch.testing.assert_close(out.loss.float(), reference, rtol=3e-2, atol=0)
    for name, p in module.drafter.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.isfinite().all(), name


def test_fp8_leaves_the_refiner_in_high_precision(tiny_target, xpress_batch, monkeypatch):
    """`model.fp8=all` converts the backbone's linears, not the refiner's (`fp8_exempt`: the loss reads its weights
    by hand); the step's loss stays close to the bf16 one (torchao's CPU path)."""
    from test_precision import needs_cpu_fp8

    if needs_cpu_fp8.args[0]:
        pytest.skip(needs_cpu_fp8.kwargs["reason"])
    pytest.importorskip("torchao")
    monkeypatch.setattr("dflash_lightning.module_settings.require_fp8", lambda *args: None)
    base = xpress_module(tiny_target).to(torch.bfloat16)
    fp8 = xpress_module(tiny_target, fp8="all").to(torch.bfloat16)
    fp8.load_state_dict(base.state_dict())
    assert type(fp8.drafter.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    assert all(type(m) is torch.nn.Linear for m in fp8.drafter.xpress_head.modules() if isinstance(m, torch.nn.Linear))
    losses = [m.step(xpress_batch, generator=torch.Generator().manual_seed(2)).loss.float() for m in (base, fp8)]
    assert not torch.equal(*losses)  # FP8 did run
    torch.testing.assert_close(losses[1], losses[0], rtol=3e-2, atol=0)


def test_prev0_is_the_token_before_the_anchor_in_its_document():
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    docs = torch.tensor([0, 0, 0, 1, 1, 1])
    assert token_before_anchor(ids, docs, torch.tensor([0, 1, 2, 3, 5])).tolist() == [5, 5, 6, 8, 9]


# -- decoding --------------------------------------------------------------------------------------------------------
def sequential_greedy(xhead, hidden, head, anchor, prev0, topc=0):
    """Left-to-right greedy: slot k's draft is the argmax of its refined logits given the drafts before it (over the
    top C of its base logits when topc)."""
    drafts = torch.zeros(hidden.shape[0], B - 1, dtype=torch.long)
    for k in range(1, B):
        prev = torch.cat([prev0[:, None], anchor[:, None], drafts[:, :-1]], 1)
        z = plain_refined(xhead, hidden, prev, head)[:, k]  # [N, V]
        if topc:
            keep = (hidden[:, k] @ head.T).topk(topc, -1).indices
            z = torch.full_like(z, float("-inf")).scatter(-1, keep, z.gather(-1, keep))
        drafts[:, k - 1] = z.argmax(-1)
    return drafts


@pytest.mark.parametrize("topc", [0, 5])
def test_after_pass_t_the_first_t_drafts_are_left_to_right_greedy(topc):
    """Jacobi passes from the base argmax: after pass t the first t drafts equal left-to-right greedy decoding (vLLM
    feeds the anchor as prev_0; another prev_0 is honoured), and B-1 passes give the whole greedy block."""
    xhead = random_head(4, scale=0.6)
    gen = torch.Generator().manual_seed(5)
    n = 16
    hidden = torch.randn(n, B, H, dtype=torch.float64, generator=gen)
    head = torch.randn(V, H, dtype=torch.float64, generator=gen)
    anchor = torch.randint(0, V, (n,), generator=gen)
    base_logits = hidden[:, 1:] @ head.T  # [N, B-1, V] what the decoder hands the drafting rule
    for prev0 in (None, torch.randint(0, V, (n,), generator=gen)):
        greedy = sequential_greedy(xhead, hidden, head, anchor, anchor if prev0 is None else prev0, topc)
        base = (hidden[:, 1:] @ head.T).argmax(-1)
        assert not torch.equal(greedy, base)  # the refiner changes drafts
        for t in range(B):
            out = jacobi_draft(xhead, hidden, base_logits, anchor, t, topc=topc, prev0=prev0)
            assert torch.equal(out.tokens[:, :t], greedy[:, :t]), t
            assert out.q is None
        assert not all(torch.equal(jacobi_draft(xhead, hidden, base_logits, anchor, t, topc=topc, prev0=prev0).tokens,
                                   greedy) for t in range(1, B - 1))  # fewer passes differ somewhere


def test_greedy_drafts_at_a_temperature_are_point_masses_unless_sampled():
    """vLLM 0.34 proposes the greedy block at any temperature (q None: point masses); the xPress harness's sampled
    drafts come with q."""
    xhead = random_head(6)
    hidden = torch.randn(4, B, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64)
    anchor = torch.randint(0, V, (4,))
    base = hidden[:, 1:] @ head.T
    greedy = jacobi_draft(xhead, hidden, base, anchor, 3)
    warm = jacobi_draft(xhead, hidden, base, anchor, 3, temperature=0.7)
    assert torch.equal(warm.tokens, greedy.tokens) and warm.q is None


@pytest.mark.parametrize(("passes", "topc"), [(1, 0), (B - 1, 0), (2, 6)])
def test_sampled_drafts_are_distributed_as_their_q(passes, topc):
    """One Gumbel draw a block shared by every pass, q_k = softmax(last pass / T): for every slot the frequency of
    each token over many blocks matches the mean of q_k (d_k ~ q_k given the slots before it, for any number of
    passes, converged or not), and q is 0 outside the top C."""
    xhead = random_head(7, scale=0.4)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(1, B, H, dtype=torch.float64, generator=gen).expand(6000, -1, -1)
    head = 0.25 * torch.randn(V, H, dtype=torch.float64, generator=gen)
    anchor = torch.full((6000,), 3)
    out = jacobi_draft(xhead, hidden, hidden[:, 1:] @ head.T, anchor, passes, topc=topc, temperature=0.8,
                       sampled=True, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(out.q.sum(-1), torch.ones(6000, B - 1, dtype=out.q.dtype))
    freq = F.one_hot(out.tokens, V).double().mean(0)  # [B-1, V]
    expected = out.q.mean(0)
    sigma = (expected * (1 - expected) / 6000).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma + 1e-3).all()
    if topc:
        assert ((out.q > 0).sum(-1) <= topc).all()


# -- the folder -----------------------------------------------------------------------------------------------------
def test_folder_fields_round_trip_and_refusals():
    s = XPressSettings(rank=64, mlp_hidden=128, num_passes=4, topc=0)
    raw = {**folder_fields(s, 16), "vocab_size": 1000}
    assert raw == {"xpress_rank": 64, "xpress_mlp_hidden": 128, "xpress_num_passes": 4, "xpress_topc": 0,
                   "xpress_block_size": 16, "sample_from_anchor": False, "vocab_size": 1000}
    assert settings_from_folder(raw, 16, "c") == s
    assert settings_from_folder({}, 16, "c") == XPressSettings(rank=256, mlp_hidden=512, num_passes=6, topc=512)
    for bad, message in [({"xpress_block_size": 8}, "xpress_block_size 8 is not block_size 16"),
                         ({"sample_from_anchor": True}, "sample_from_anchor True"),
                         ({"xpress_rank": 64.0}, "xpress_rank must be an integer"),
                         ({"xpress_topc": -1}, "xpress_topc must be an integer >= 0"),
                         ({"draft_vocab_size": 500}, "draft_vocab_size 500")]:
        with pytest.raises(ConfigError, match=message):
            settings_from_folder({**raw, **bad}, 16, "c")


def speculators_folder(xhead: XPressHead, backbone: dict) -> tuple[dict, dict]:
    """A folder as speculators 0.9 saves an XPress drafter (models/xpress/{config,core}.py, read from its wheel):
    pydantic config fields, the Qwen3 layer config as a diff against Qwen3Config's defaults, hidden-state layer ids;
    the backbone's weights under their own names and the refiner's under `refiner_head.`."""
    raw = {"speculators_model_type": "xpress", "architectures": ["XPressSpeculator"], "block_size": B,
           "draft_vocab_size": V, "aux_hidden_state_layer_ids": [2, 4], "mask_token_id": V - 1,
           "sliding_window_non_causal": False, "sample_from_anchor": False, "xpress_rank": R, "xpress_mlp_ratio": 2,
           "num_jacobi_passes": 6, "transformer_layer_config": {
               "model_type": "qwen3", "vocab_size": V, "hidden_size": H, "intermediate_size": 40,
               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6}}
    ours = {v: k for k, v in SPECULATORS_NAMES.items()}
    state = {"refiner_head." + ours[k]: v for k, v in xhead.state_dict().items()}
    return raw, {**backbone, **state}


def test_speculators_folder_converts_to_the_served_one():
    """speculators' config and refiner names become section 14's folder: Qwen3 fields filled from transformers'
    defaults, layer ids - 1, M = r x ratio, every refiner tensor under its folder name, the backbone's untouched."""
    xhead = random_head(9)
    backbone = {"fc.weight": torch.randn(H, 2 * H), "norm.weight": torch.ones(H)}
    raw, state = speculators_folder(xhead, backbone)
    config, weights = from_speculators(raw, state, num_target_layers=6, source="spec")
    assert config["architectures"] == ["Qwen3XPressModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [1, 3]}
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_target_layers", "block_size",
                                   "rms_norm_eps", "max_position_embeddings")} == {
        "hidden_size": H, "num_hidden_layers": 1, "num_target_layers": 6, "block_size": B, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768}  # the last two: Qwen3Config's defaults
    assert settings_from_folder(config, B, "c") == XPressSettings(rank=R, mlp_hidden=2 * R, num_passes=6, topc=0)
    assert set(weights) == set(backbone) | {PREFIX + k for k in xhead.state_dict()}
    for k, v in xhead.state_dict().items():
        assert torch.equal(weights[PREFIX + k], v)
    for bad, message in [({"sample_from_anchor": True}, "sample_from_anchor"),
                         ({"draft_vocab_size": 32}, "draft_vocab_size 32"),
                         ({"speculators_model_type": "dspark"}, "is not 'xpress'")]:
        with pytest.raises(ConfigError, match=message):
            from_speculators({**raw, **bad}, state, 6, "spec")
    with pytest.raises(ConfigError, match="unknown refiner weight 'refiner_head.gate'"):
        from_speculators(raw, {**state, "refiner_head.gate": torch.ones(1)}, 6, "spec")


def test_import_folder_reads_speculators_own_xpress_folder(tiny_target, tmp_path):
    """speculators 0.9's own `xpress` folder of a drafter (its config fields, its Qwen3 diff, hidden-state layer ids,
    its refiner's names) imports as that drafter, converted, given the target's layer count as `evaluate` and warm
    start give it; without it, one line says what to give; a warm start reads it."""
    import json

    from safetensors.torch import save_file

    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.folder.reader import import_folder
    from dflash_lightning.long_runs.warm_start import warm_start
    from dflash_lightning.model import DFlashDrafter
    from dflash_lightning.target_model import load_target_config, tokenizer_ids

    settings = XPressSettings(rank=16, mlp_hidden=64, num_passes=4)
    cfg = DrafterConfig(num_layers=2, block_size=B, variant="xpress", xpress=settings).resolved(
        load_target_config(str(tiny_target)), *tokenizer_ids(str(tiny_target)))
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    for p in drafter.parameters():
        p.data += 0.1 * torch.randn_like(p)
    theirs = {v: k for k, v in SPECULATORS_NAMES.items()}
    state = {"refiner_head." + theirs[k.removeprefix(PREFIX)] if k.startswith(PREFIX) else k: v
             for k, v in drafter.state_dict().items()}
    layer = {"model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
             "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
             "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings}
    raw = {"speculators_model_type": "xpress", "architectures": ["XPressSpeculator"], "block_size": B,
           "draft_vocab_size": cfg.vocab_size, "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
           "mask_token_id": cfg.mask_token_id, "xpress_rank": 16, "xpress_mlp_ratio": 4, "num_jacobi_passes": 4,
           "transformer_layer_config": layer,
           "speculators_config": {"verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": []}}}
    folder = tmp_path / "speculators"
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"does not record its target's layer count; give the target it was "
                                          r"trained for \(its speculators_config names Qwen/Qwen3-8B\)$"):
        import_folder(folder)
    back, weights = import_folder(folder, cfg.num_target_layers)
    assert back.variant == "xpress" and back.xpress == settings
    training = set(cfg.training_fields())
    assert {k: v for k, v in back.flat_dict().items() if k not in training} == {
        k: v for k, v in cfg.flat_dict().items() if k not in training}
    expected = drafter.state_dict()
    assert set(weights) == set(expected) and all(torch.equal(weights[k], expected[k]) for k in expected)
    fresh = DFlashDrafter(cfg)
    warm_start(fresh, str(folder))
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())


def test_warm_start_from_an_xpress_drafter_of_another_shape_is_refused_naming_the_field(tiny_target, tmp_path):
    """The refiner's fields a folder carries (`config_fields`: rank, MLP width, passes, top C) must match: a source of
    another rank is refused in one line naming it, not by a tensor size error; a training choice may differ."""
    from dataclasses import replace

    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.folder.writer import write_folder
    from dflash_lightning.long_runs.warm_start import warm_start
    from dflash_lightning.model import DFlashDrafter
    from dflash_lightning.target_model import load_target_config, tokenizer_ids

    def drafter(**settings):
        cfg = DrafterConfig(num_layers=1, block_size=B, variant="xpress", xpress=XPressSettings(**settings))
        return DFlashDrafter(cfg.resolved(load_target_config(str(tiny_target)), *tokenizer_ids(str(tiny_target))))

    source = drafter(rank=32, mlp_hidden=64)
    folder = write_folder(source.config, source.state_dict(), tmp_path / "r32")
    with pytest.raises(ConfigError, match=r"^model.init_from '.*': its drafter differs from this run's in "
                                          r"xpress.rank$"):
        warm_start(drafter(rank=16, mlp_hidden=64), str(folder))
    same = drafter(**{**vars(replace(source.config.xpress)), "consistency_rounds": 1})  # a training choice
    warm_start(same, str(folder))


# -- engines ---------------------------------------------------------------------------------------------------------
def engine_cases(engine: str, work: Path) -> list[tuple[dict, dict]]:
    """vLLM's XPress refiner's case (tests/test_engine_drafts.py runs it with its folders, through
    tests/xpress_engines.py): the config.json and `xpress_head.*` weights of a folder we export, inputs, and ours:
    the refined logits and the drafts of our drafting rule (`XPress.draft`, as the decoder calls it: the anchor as
    prev_0) over the full vocabulary (`xpress_topc: 0`, what we export) and over the top 7."""
    import json
    from dataclasses import replace

    from safetensors.torch import load_file

    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.folder.writer import write_folder
    from dflash_lightning.model import DFlashDrafter
    from dflash_lightning.parts.base import DraftInputs

    cfg = DrafterConfig(num_layers=1, block_size=B, mask_token_id=V - 1, target_layer_ids=[1], hidden_size=H,
                        intermediate_size=2 * H, num_attention_heads=2, num_key_value_heads=1, head_dim=12,
                        rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, vocab_size=V,
                        num_target_layers=4, variant="xpress", xpress=XPressSettings(rank=16, mlp_hidden=64,
                                                                                     num_passes=3))
    torch.manual_seed(10)
    drafter = DFlashDrafter(cfg)
    for p in drafter.parameters():
        p.data.normal_(0, 0.3)
    folder = write_folder(cfg, drafter.state_dict(), work / "folder")
    config = json.loads((folder / "config.json").read_text())
    assert config["xpress_topc"] == 0
    weights = {k: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith(PREFIX)}
    part = drafter.parts[0]
    xhead = part.head
    gen = torch.Generator().manual_seed(11)
    n = 6
    hidden = torch.randn(n, B, H, generator=gen)
    head = torch.randn(V, H, generator=gen)
    anchor = torch.randint(0, V, (n,), generator=gen)
    prev = torch.randint(0, V, (n, B), generator=gen)
    _, speculators = speculators_folder(xhead, {})  # the names from_speculators reads back
    case = {"vocab_size": V, "hidden_size": H, "block_size": B, "config": config, "weights": weights,
            "speculators_weights": speculators, "inputs": {"hidden": hidden, "head": head, "anchor": anchor,
                                                           "prev": prev},
            "num_passes": config["xpress_num_passes"], "topc": 7}
    with torch.no_grad():
        ours = {"refined": xhead(hidden, prev, head)}
    for topc, key in ((0, "greedy"), (7, "greedy_topc")):
        part.settings = replace(cfg.xpress, topc=topc)
        ours[key] = torch.stack([part.draft(DraftInputs(hidden[i, 1:], hidden[i, 1:] @ head.T, anchor[i], None, head,
                                                        0.0, None, hidden[i])).tokens for i in range(n)])
    return [(case, ours)]


def check_engine(engine: str, cases: list[tuple[dict, dict]], outs: list[dict]) -> None:
    """vLLM 0.34's own XPress refiner (qwen3_xpress.py and its Jacobi kernels, from the 0.34 wheel, on the engine
    venv's vLLM 0.32 for the CPU, kernels in Triton's interpreter), built from our config.json and loaded with its
    `xpress_head.*` weights by its `load_weights`, misses no weight and knows every one, gives our refined logits and
    our drafts (full vocabulary and top C); speculators 0.9's own refiner gives the same logits from the names
    `from_speculators` reads."""
    for (_, ours), theirs in zip(cases, outs, strict=True):
        assert not theirs["missing"] and not theirs["unexpected"], theirs
        torch.testing.assert_close(theirs["refined"], ours["refined"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs["speculators_refined"], ours["refined"], rtol=1e-5, atol=1e-5)
        for key in ("greedy", "greedy_topc"):
            assert torch.equal(theirs[key], ours[key]), key
