"""Domino (docs/method.md section 13) against plain references written here: the prefix GRU, the corrected logits and
the curriculum loss (values and gradients, chunked as the head loop runs it, with at most two [rows, V] buffers), the
lambda schedule, greedy drafting as SGLang 0.5.23 does it (full vocabulary and candidate pool), the settings, the
folder's fields and weights, the metrics; fixed shapes under torch.compile; SGLang's own Domino code on our folder."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dflash_lightning.config import DrafterConfig
from dflash_lightning.errors import ConfigError
from dflash_lightning.loss import LossSettings, chunked_head_loss
from dflash_lightning.parts.domino import (
    FOLDER_DTYPE,
    SGLANG_POOL,
    DominoCorrection,
    DominoHead,
    DominoMetrics,
    DominoSettings,
    folder_fields,
    greedy_draft,
    gru_step,
    lambda_base,
    prefix_states,
    read_folder_fields,
    sglang_flags,
    weight_shapes,
)

# What the references say, read from (not copied out of) their wheels:
#  - SGLang 0.5.23 (the serving reference). srt/speculative/dflash_utils.py parse_dflash_draft_config: with
#    dflash_config.projector_type "domino" it requires shift_label to be a JSON bool, pure_draft_prefix_len == 1,
#    gru_hidden_dim and emb_dim (each read from dflash_config, else the top level; a top-level emb_dim must equal the
#    nested one). srt/models/dflash.py DFlashDraftModel builds prefix_gru = nn.GRU(H, G, 1 layer, batch_first, no
#    bias) and embed_proj = Sequential(Linear(H+G, E), SiLU, Linear(E, V)), no biases; load_weights refuses these
#    names when projector_type is not domino, checks their shapes, requires all four, and silently skips names it
#    has no parameter for. srt/speculative/domino_utils.py domino_greedy_rollout (shift_label true): hidden slots
#    0..B-2 draft; d_1 = full-vocabulary argmax head(h_0); s = nn.GRU([E(x_p), E(d_1)]) (target embedding, zero
#    initial state); slot k = 1..B-2: argmax(head(h_k) + embed_proj([h_k; s])), then aten gru_cell on E(d_{k+1}).
#    With 0 < pool < V the candidates are the top `pool` of each request's max over slots 1..B-2 of the base logits,
#    shared by those slots (--speculative-domino-candidate-pool-size, default 2048; 0 = full vocabulary).
#    validate_domino_runtime wants CUDA and bf16 target embedding, head and projector weights. dflash_worker_v2.py:
#    Domino drafts greedily at every temperature (block verification "has no effect": a point mass).
#  - SpecForge 0.2.0 (specforge/modeling/draft/domino.py, algorithms/common/dflash_family_model.py
#    OnlineDominoModel, training/strategies/base.py): GRU over the target embeddings of t_p..t_{p+B-1} (shift_label),
#    prefix states from slot P; labels t_{p+k+1}; weights: valid anchor x in-range x loss mask (no running product),
#    x exp(-k / gamma); final and base losses share one denominator sum(w) + 1e-6 (per rank);
#    lambda = clamp(start * (1 - min(step / max(1, int(ratio * total)), 1))), start 1.0, ratio 0.5; no total: 0.
#    pure_draft_prefix_len defaults to 0 and shift_label to false when the config lacks them.
#  - ModelOpt 0.47.0 (plugins/hf_domino.py, modeling_domino.py, export/plugins/hf_spec_export.py DominoExporter,
#    modelopt_recipes/.../domino.yaml): the same GRU inputs, loss, weights (no running product) and lambda rule
#    (ratio default 1.0, start in [0, 1], ratio in (0, 1]); no max_steps: lambda 0 from the first step (a warning);
#    recipe B 16, gamma 7, E 256, G 1024, P 1, shift_label true; init: embed_proj normal(0, 0.02), GRU PyTorch's
#    default; its evaluation runs the backbone only. Export: DFlashDraftModel config plus dflash_config
#    {projector_type, shift_label, pure_draft_prefix_len, gru_hidden_dim, emb_dim} and a top-level emb_dim, dtype
#    as `torch_dtype`.
# Section 13 differs from both trainers in one place: its m_k is section 12's running product (a slot counts only
# where every slot before it in the block does), which here comes with the anchor-first layout.

V, H, B, G, E = 50, 16, 5, 12, 6


def domino(seed: int = 0, g: int = G, e: int = E, h: int = H, v: int = V) -> DominoHead:
    """A fp64 head with weights large enough that the correction moves argmaxes (a fresh one's 0.02 would not)."""
    torch.manual_seed(seed)
    m = DominoHead(h, v, g, e).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, p.shape[1] ** -0.5 * 1.5)
    return m


def tensors(a: int = 4, b: int = B, seed: int = 1, h: int = H, v: int = V) -> SimpleNamespace:
    """Backbone outputs, block tokens, labels, slot weights (some zero), target embedding and head, fp64."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, v, (a, b + 1), generator=g)
    weights = torch.exp(-torch.arange(b, dtype=torch.float64) / 7).repeat(a, 1)
    weights[1, 3:] = 0  # a block whose supervision stops
    weights[2] = 0  # an invalid anchor
    return SimpleNamespace(hidden=torch.randn(a, b, h, generator=g, dtype=torch.float64) * 2,
                           block_tokens=tokens[:, :b], labels=tokens[:, 1:], weights=weights,
                           embed=torch.randn(v, h, generator=g, dtype=torch.float64),
                           head=torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5)


# ---- the GRU ------------------------------------------------------------------------------------------------------


def torch_gru(m: DominoHead):
    """PyTorch's own GRU (what SGLang, SpecForge and ModelOpt run) on the part's GRU weights (gradients reach them)."""
    w = m.prefix_gru
    gru = torch.nn.GRU(w.weight_ih_l0.shape[1], w.weight_hh_l0.shape[1], bias=False, batch_first=True)
    return lambda *args: torch.func.functional_call(gru, dict(w.named_parameters()), args)


def test_the_hand_gru_is_torchs_gru():
    """gru_states (the fixed loop the part traces) equals nn.GRU's forward, and gru_step aten's gru_cell (what SGLang
    steps with), from zero and from a given state."""
    m = domino()
    x = torch.randn(3, 7, H, dtype=torch.float64)
    s0 = torch.randn(3, G, dtype=torch.float64)
    gru = torch_gru(m)
    torch.testing.assert_close(m.prefix_gru(x), gru(x)[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.prefix_gru(x, s0), gru(x, s0[None])[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.prefix_gru.step(x[:, 0], s0), gru(x[:, :1], s0[None])[0][:, 0])
    w_ih, w_hh = m.prefix_gru.weight_ih_l0, m.prefix_gru.weight_hh_l0
    cell = torch.ops.aten.gru_cell.default(x[:, 0], s0, w_ih, w_hh, None, None)
    torch.testing.assert_close(gru_step(w_ih, w_hh, F.linear(x[:, 0], w_ih), s0), cell, rtol=1e-12, atol=1e-12)


def test_prefix_states_see_the_true_tokens_up_to_their_slot():
    """s_k is the GRU over the target embeddings of t_p..t_{p+k}: changing t_{p+j} changes s_k for k >= j only; the
    target embedding gets no gradient."""
    m, t = domino(), tensors()
    embed = t.embed.clone().requires_grad_()
    s = prefix_states(m, embed, t.block_tokens)  # [A, B, G]
    torch.testing.assert_close(s, torch_gru(m)(t.embed[t.block_tokens])[0])
    changed = t.block_tokens.clone()
    changed[:, 2] = (changed[:, 2] + 1) % V
    s2 = prefix_states(m, embed, changed)
    assert torch.equal(s[:, :2], s2[:, :2]) and (s[:, 2:] - s2[:, 2:]).abs().amin() > 0
    s.sum().backward()
    assert embed.grad is None


# ---- weights, init, settings ----------------------------------------------------------------------------------------


def test_weight_names_and_shapes_are_section_13s():
    """Exactly section 13's four tensors, no biases, with its shapes; the init the trainers use."""
    settings = DominoSettings(gru_hidden_dim=64, emb_dim=24)
    m = DominoHead(H, V, 64, 24)
    ours = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert ours == {"prefix_gru.weight_ih_l0": (3 * 64, H), "prefix_gru.weight_hh_l0": (3 * 64, 64),
                    "embed_proj.0.weight": (24, H + 64), "embed_proj.2.weight": (V, 24)}
    assert ours == weight_shapes(settings, H, V)
    bound = 64**-0.5  # nn.GRU's default: uniform(-1/sqrt(G), 1/sqrt(G))
    for w in (m.prefix_gru.weight_ih_l0, m.prefix_gru.weight_hh_l0):
        assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    big = DominoHead(64, 2000, 8, 64)
    for w in (big.proj_in, big.proj_out):
        assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002


@pytest.mark.parametrize(("field", "value", "message"), [
    ("gru_hidden_dim", 0, "domino.gru_hidden_dim must be an integer >= 1"),
    ("emb_dim", 2.5, "domino.emb_dim must be an integer >= 1"),
    ("pure_draft_prefix_len", 0, "domino.pure_draft_prefix_len must be 1"),
    ("lambda_base_start", 1.5, "domino.lambda_base_start must be in [0, 1]"),
    ("lambda_base_decay_ratio", 0.0, "domino.lambda_base_decay_ratio must be in (0, 1]"),
    ("candidate_pool_size", -1, "domino.candidate_pool_size must be an integer >= 0"),
])
def test_settings_refuse_a_bad_value_naming_the_field(field, value, message):
    settings = DominoSettings(**{field: value})
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        settings.check(SimpleNamespace(block_size=16))
    DominoSettings().check(SimpleNamespace(block_size=16))
    with pytest.raises(ConfigError, match="domino: block_size must be >= 2"):
        DominoSettings().check(SimpleNamespace(block_size=1))


def test_lambda_schedule():
    """lambda = start (1 - step / max(1, floor(ratio total))), then 0: the trainers' rule, by hand; a curriculum
    that starts above 0 needs the run's total, one that starts at 0 does not."""
    assert [lambda_base(s, 10) for s in (0, 1, 5, 9, 10, 50)] == [1.0, 0.9, 0.5, pytest.approx(0.1), 0.0, 0.0]
    assert lambda_base(2, 10, decay_ratio=0.45) == pytest.approx(0.5)  # floor(4.5) = 4 decay steps
    assert lambda_base(3, 10, start=0.5, decay_ratio=0.5) == pytest.approx(0.2)
    assert lambda_base(0, 1, decay_ratio=0.1) == 1.0 and lambda_base(1, 1, decay_ratio=0.1) == 0.0
    assert lambda_base(7, None, start=0.0) == 0.0
    assert DominoSettings().needs_total_steps and not DominoSettings(lambda_base_start=0.0).needs_total_steps
    for total in (None, 0):
        with pytest.raises(ValueError, match="total optimizer steps"):
            lambda_base(3, total)


# ---- the loss -------------------------------------------------------------------------------------------------------


def reference_loss(m: DominoHead, t: SimpleNamespace, hidden: torch.Tensor, lam: float, pure: int = 1):
    """Section 13's loss with whole tensors and autograd: torch's GRU and the projector's own forward."""
    s = torch_gru(m)(t.embed[t.block_tokens])[0]  # [A, B, G]
    base = hidden @ t.head.T  # [A, B, V]
    keep = (torch.arange(hidden.shape[1]) >= pure).to(hidden.dtype)[None, :, None]
    final = base + keep * m.embed_proj(torch.cat([hidden, s], -1))
    ce_final = F.cross_entropy(final.flatten(0, 1), t.labels.flatten(), reduction="none")
    ce_base = F.cross_entropy(base.flatten(0, 1), t.labels.flatten(), reduction="none")
    w = t.weights.flatten()
    right = torch.stack([final.argmax(-1) == t.labels, base.argmax(-1) == t.labels], -1).flatten(0, 1)
    return (w * ((1 - lam) * ce_final + lam * ce_base)).sum(), (w * ce_final).sum(), (w * ce_base).sum(), right


DECAY = LossSettings(loss_weights="decay")


def part_of(m: DominoHead, pure: int = 1, block: int = B) -> DominoCorrection:
    """The part around a head `m` (its settings from m's shapes; P unchecked, so that P 0 and 2 can be tried)."""
    g, e, v = m.prefix_gru.weight_hh_l0.shape[1], m.proj_in.shape[0], m.proj_out.shape[0]
    cfg = SimpleNamespace(domino=DominoSettings(gru_hidden_dim=g, emb_dim=e, pure_draft_prefix_len=pure),
                          block_size=block, hidden_size=m.proj_in.shape[1] - g, vocab_size=v)
    part = DominoCorrection(cfg)
    part.head = m
    return part


def ours_loss(m: DominoHead, t: SimpleNamespace, hidden: torch.Tensor, lam, chunk: int, pure: int = 1):
    """The head loop with the part in it (as the drafter's forward runs it): total, sum w CE(f), sum w CE(b), hits."""
    s = prefix_states(m, t.embed, t.block_tokens)
    lam = torch.as_tensor(lam, dtype=hidden.dtype)
    total, ce, _, _, [(logged, (right,))] = chunked_head_loss(
        hidden.flatten(0, 1), t.head, t.labels.flatten(), t.weights.flatten(), chunk, 0, hidden.shape[1], DECAY,
        parts=((part_of(m, pure, hidden.shape[1]), (s.flatten(0, 1), lam)),))
    assert torch.equal(ce, logged[0])  # the loop's CE is f's, what is served
    return total, logged[0], logged[1], right


@pytest.mark.parametrize("lam", [0.0, 0.37, 1.0])
@pytest.mark.parametrize(("chunk", "pure"), [(B, 1), (2 * B, 1), (100, 1), (2 * B, 0), (2 * B, 2)])
def test_chunked_loss_and_gradients_equal_the_reference(lam, chunk, pure):
    """Values, logged sums, per-row hits and the gradients of the backbone's outputs, the GRU's and the projector's
    weights equal the plain reference for lambda 0, 1 and between, chunked by one, two and all blocks; slots below P
    keep the pure head. At lambda 1 the projector and the GRU get exact zeros (DDP sees every parameter used)."""
    t = tensors()
    results = []
    for fn in (reference_loss, ours_loss):
        m = domino()
        hidden = t.hidden.clone().requires_grad_()
        out = fn(m, t, hidden, lam, pure=pure, **({"chunk": chunk} if fn is ours_loss else {}))
        out[0].backward()
        results.append((out, hidden.grad, {k: p.grad for k, p in m.named_parameters()}))
    (ref, ref_gh, ref_gp), (ours, gh, gp) = results
    for a, b in zip(ours[:3], ref[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert torch.equal(ours[3], ref[3])
    torch.testing.assert_close(gh, ref_gh, rtol=1e-9, atol=1e-10)
    for k in ref_gp:
        torch.testing.assert_close(gp[k], ref_gp[k], rtol=1e-9, atol=1e-10, msg=k)
    if lam == 1.0:
        assert all(not g.abs().max() for g in gp.values())


def test_slot_0_keeps_the_pure_head_and_the_losses_share_their_weights():
    """With P = 1 slot 0's CE is the same in both terms, so it is weighted 1 whatever lambda is: changing the
    projector leaves slot-0-only losses unchanged."""
    t = tensors()
    t.weights = torch.zeros_like(t.weights)
    t.weights[:, 0] = 1.0
    values = []
    for seed in (0, 1):
        for lam in (0.0, 0.6):
            values.append(ours_loss(domino(seed), t, t.hidden, lam, chunk=2 * B)[0])
    assert torch.allclose(torch.stack(values), values[0], rtol=1e-12)


class LiveRows(TorchDispatchMode):
    """The most tensors of at least `numel` elements (distinct storages, made inside the mode) alive at once."""

    def __init__(self, numel: int, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.numel, self.live, self.peak = numel, [], 0
        self.inputs = {x.untyped_storage().data_ptr() for x in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.numel() >= self.numel:
                self.live.append(weakref.ref(x))
        storages = {r().untyped_storage().data_ptr() for r in self.live if r() is not None} - self.inputs
        self.peak = max(self.peak, len(storages))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_chunk_holds_at_most_two_rows_by_vocabulary_tensors(dtype):
    """Inside the head loop no more than two [rows, V] tensors are alive at any op (b and f, turned in place into
    their softmax and gradients); V large beside every other width, as 151936 is."""
    v, rows = 600, 2 * B
    t = tensors(a=6, v=v)
    m = domino(v=v).to(dtype)
    s = prefix_states(m, t.embed.to(dtype), t.block_tokens).detach().flatten(0, 1)
    hidden, head = t.hidden.to(dtype).flatten(0, 1), t.head.to(dtype)
    inputs = (s, torch.tensor(0.4, dtype=dtype))
    watch = LiveRows(rows * v, [hidden, s, head, *m.parameters()])
    with watch:
        chunked_head_loss(hidden, head, t.labels.flatten(), t.weights.flatten().to(dtype), rows, 0, B, DECAY,
                          parts=((part_of(m), inputs),))
    assert watch.peak == 2


def test_bf16_compute_with_fp32_weights_follows_the_reference():
    """Under bf16 compute (hidden, head and states bf16, the part's weights fp32 masters) the loss and the
    gradients stay near the fp64 reference; the weights' gradients come back fp32."""
    t = tensors()
    ref_m = domino()
    ref_h = t.hidden.clone().requires_grad_()
    ref = reference_loss(ref_m, t, ref_h, 0.5)[0]
    ref.backward()
    m = domino().float()
    hidden = t.hidden.bfloat16().requires_grad_()
    s = prefix_states(m, t.embed.bfloat16(), t.block_tokens)
    total, *_ = chunked_head_loss(hidden.flatten(0, 1), t.head.bfloat16(), t.labels.flatten(), t.weights.flatten(),
                                  2 * B, 0, B, DECAY, parts=((part_of(m), (s.flatten(0, 1), torch.tensor(0.5))),))
    total.backward()
    torch.testing.assert_close(total.double(), ref, rtol=2e-2, atol=0)
    torch.testing.assert_close(hidden.grad.double(), ref_h.grad, rtol=0.1, atol=0.05)
    assert m.proj_out.grad.dtype == torch.float32
    torch.testing.assert_close(m.proj_out.grad.double(), ref_m.proj_out.grad, rtol=0.1, atol=0.02)


def test_the_loss_compiles_once_for_every_lambda():
    """The GRU states and the head loop with the part in it trace as one graph (no graph break: nn.GRU is not
    called) and a new lambda, labels and weights do not recompile (lambda is a 0-dim tensor); no host sync in it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = domino().float()
    part = part_of(m)

    def step(hidden, tokens, embed, head, labels, weights, lam):
        s = prefix_states(m, embed, tokens)
        return chunked_head_loss(hidden.flatten(0, 1), head, labels, weights, 2 * B, 3, B, DECAY,
                                 parts=((part, (s.flatten(0, 1), lam)),))[0]

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    counters.clear()
    for seed, lam in ((1, 1.0), (2, 0.3)):
        t = tensors(seed=seed)
        hidden = t.hidden.float().requires_grad_()
        args = (hidden, t.block_tokens, t.embed.float(), t.head.float(), t.labels.flatten(),
                t.weights.flatten().float(), torch.tensor(lam))
        total = compiled(*args)
        torch.testing.assert_close(total, step(*args))
        total.backward()
    assert len(graphs) == 1 and not counters["recompiles"] and not counters["graph_break"]
    sync_ops = ("item", "tolist", torch.ops.aten._local_scalar_dense.default)
    assert not [node for node in graphs[0].graph.nodes if node.target in sync_ops]


# ---- decoding -------------------------------------------------------------------------------------------------------


def reference_drafts(m: DominoHead, hidden, logits, first, embed, pure: int = 1, pool: int = 0) -> torch.Tensor:
    """Block by block, slot by slot: torch's GRU re-run from zero over [x_p, drafts so far] for each corrected slot,
    the projector's forward, the pool as a mask of the full-vocabulary scores."""
    out = []
    for i in range(hidden.shape[0]):
        drafts = []
        n, v = logits.shape[1:]
        allowed = torch.ones(v, dtype=torch.bool)
        if 0 < pool < v:
            allowed = torch.zeros(v, dtype=torch.bool)
            allowed[logits[i, pure:].amax(0).topk(pool).indices] = True
        for k in range(n):
            if k < pure:
                drafts.append(int(logits[i, k].argmax()))
                continue
            s = torch_gru(m)(embed[torch.tensor([int(first[i]), *drafts])][None])[0][0, -1]
            score = logits[i, k] + m.embed_proj(torch.cat([hidden[i, k], s]))
            drafts.append(int(score.masked_fill(~allowed, float("-inf")).argmax()))
        out.append(drafts)
    return torch.tensor(out)


@pytest.mark.parametrize(("pure", "pool"), [(1, 0), (1, V), (1, 7), (0, 0), (2, 5)])
def test_greedy_drafts_equal_a_slot_by_slot_reference(pure, pool):
    """Full vocabulary (pool 0, or >= V), a shared candidate pool, other P."""
    m, t = domino(), tensors(a=6)
    hidden = t.hidden[:, : B - 1]
    logits = hidden @ t.head.T
    first = t.block_tokens[:, 0]
    ours = greedy_draft(m, hidden, logits, first, t.embed, pure, pool)
    assert ours.shape == (6, B - 1)
    assert torch.equal(ours, reference_drafts(m, hidden, logits, first, t.embed, pure, pool))
    if pure == 1 and pool == 0:  # the correction decides some drafts, or the test would not see it
        assert not torch.equal(ours[:, 1:], logits[:, 1:].argmax(-1))


def test_greedy_drafts_are_the_argmax_of_the_training_logits_along_their_own_chain():
    """Teacher-forced on the chain it drafted (block tokens x_p, d_1, ..), the training path's f has the drafts as
    its argmax at every drafting slot: training scores what decoding serves."""
    m, t = domino(), tensors(a=6)
    logits = t.hidden @ t.head.T  # [A, B, V]
    first = t.block_tokens[:, 0]
    drafts = greedy_draft(m, t.hidden[:, : B - 1], logits[:, : B - 1], first, t.embed)
    tokens = torch.cat([first[:, None], drafts], 1)  # [A, B]: x_p and the B - 1 drafts
    s = prefix_states(m, t.embed, tokens)
    final = logits + (torch.arange(B) >= 1)[None, :, None] * m.embed_proj(torch.cat([t.hidden, s], -1))
    assert torch.equal(final[:, : B - 1].argmax(-1), drafts)


def test_a_two_slot_block_drafts_with_the_pure_head_alone():
    m, t = domino(), tensors(b=2)
    logits = t.hidden[:, :1] @ t.head.T
    assert torch.equal(greedy_draft(m, t.hidden[:, :1], logits, t.block_tokens[:, 0], t.embed),
                       logits.argmax(-1))


# ---- the folder -----------------------------------------------------------------------------------------------------


def test_folder_fields_round_trip_and_are_what_sglang_reads():
    settings = DominoSettings(gru_hidden_dim=64, emb_dim=32, lambda_base_start=0.5, candidate_pool_size=0)
    dflash, top = folder_fields(settings)
    assert dflash == {"projector_type": "domino", "shift_label": True, "pure_draft_prefix_len": 1,
                      "gru_hidden_dim": 64, "emb_dim": 32}
    assert top == {"emb_dim": 32}
    assert json.loads(json.dumps(dflash))["shift_label"] is True  # a JSON bool, as SGLang requires
    back = read_folder_fields(dflash, top, "f/config.json")
    assert back == DominoSettings(gru_hidden_dim=64, emb_dim=32)  # training choices at their defaults
    assert read_folder_fields(dflash, {}, "f") == back
    assert read_folder_fields({**dflash, "emb_dim": None}, top, "f") == back
    assert DominoCorrection.folder_dtype == FOLDER_DTYPE == "bfloat16"
    assert sglang_flags(DominoSettings()) == ["--dtype bfloat16"] and SGLANG_POOL == 2048
    assert sglang_flags(settings) == ["--dtype bfloat16", "--speculative-domino-candidate-pool-size 0"]


@pytest.mark.parametrize(("change", "top", "message"), [
    ({"projector_type": None}, {}, "f: dflash_config.projector_type must be 'domino', got None"),
    ({"shift_label": False}, {}, "f: dflash_config.shift_label must be true"),
    ({"shift_label": "true"}, {}, "f: dflash_config.shift_label must be true"),
    ({"pure_draft_prefix_len": 0}, {}, "f: domino.pure_draft_prefix_len must be 1"),
    ({"gru_hidden_dim": 64.0}, {}, "f: dflash_config.gru_hidden_dim must be an integer"),
    ({"emb_dim": 32}, {"emb_dim": 16}, r"f: dflash_config.emb_dim \(32\) and the top-level emb_dim \(16\) differ"),
    ({"emb_dim": None}, {}, "f: a Domino folder needs dflash_config.emb_dim"),
])
def test_reading_a_folder_refuses_what_sglang_refuses_naming_the_field(change, top, message):
    dflash = {**folder_fields(DominoSettings(gru_hidden_dim=64, emb_dim=32))[0], **change}
    with pytest.raises(ConfigError, match=message):
        read_folder_fields({k: v for k, v in dflash.items() if v is not None}, top, "f")


# ---- metrics --------------------------------------------------------------------------------------------------------


def test_metrics_against_a_plain_loop():
    """Per-slot accuracy of f and of head(h), and 1 + the accepted prefix over the drafting slots 0..B-2 (slot B-1
    trains but does not draft), blocks counted where slot 0 is supervised."""
    g = torch.Generator().manual_seed(3)
    rows = torch.rand(7, B, 2, generator=g) > 0.3
    supervised = torch.ones(7, B, dtype=torch.bool)
    supervised[1, 2:] = False
    supervised[4] = False
    metric = DominoMetrics(B)
    metric.update(rows, None, supervised)
    out = metric.compute()
    for col, name in ((0, "tau"), (1, "base_tau")):
        accepted, blocks = 0, 0
        for i in range(7):
            if not supervised[i, 0]:
                continue
            blocks += 1
            for k in range(B - 1):
                if not (rows[i, k, col] and supervised[i, k]):
                    break
                accepted += 1
        assert out[f"domino/{name}"].item() == pytest.approx(1 + accepted / blocks)
    for k in range(B):
        m = supervised[:, k]
        assert out[f"domino/acc/slot_{k:02d}"].item() == pytest.approx(rows[m, k, 0].float().mean().item())
        assert out[f"domino/base_acc/slot_{k:02d}"].item() == pytest.approx(rows[m, k, 1].float().mean().item())


# ---- the preset: the drafter's forward, the run's checks, the curriculum, export and import ---------------------


def domino_drafter(block: int = 4, seed: int = 0):
    """A two-layer fp64 Domino drafter (width 32, vocabulary 40) with its weights off their initialisation."""
    from test_model import tiny_drafter

    drafter = tiny_drafter(block=block, seed=seed, variant="domino", domino=DominoSettings(gru_hidden_dim=8, emb_dim=4))
    with torch.no_grad():
        for p in drafter.embed_proj.parameters():
            p.normal_(0, 0.3)
    return drafter


def test_the_drafters_forward_trains_section_13s_loss_on_the_blocks_true_tokens():
    """The drafter's training forward (anchor-first rows, the GRU over each block's true tokens t_p..t_{p+B-1} from
    `TrainInputs.before`, lambda from the part's curriculum) equals the loss written densely from the block states;
    the GRU, the projector and the backbone get gradients; the logged CEs are f's and b's."""
    from helpers import packed_batch

    from dflash_lightning.blocks import select_anchors, slot_weights
    from dflash_lightning.parts.domino import LAYOUT

    drafter = domino_drafter()
    part = drafter.parts[0]
    part.curriculum.lam.fill_(0.3)
    batch = packed_batch([30, 18], 64, seed=1)
    features = torch.randn(64, 96, dtype=torch.float64)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 10, torch.Generator().manual_seed(2))
    args = (features, batch["input_ids"], batch["position_ids"], batch["doc_ids"], batch["loss_mask"], anchors, valid,
            slot_weights(4, 7.0, layout=LAYOUT).double())
    out = drafter(*args, topk=2)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    with torch.no_grad():
        hidden = drafter.block_hidden(*args[:4], anchors, valid)  # [A, B, H]
        tokens = batch["input_ids"][(anchors[:, None] + torch.arange(4)).clamp(max=63)]  # t_p..t_{p+3}
        s = torch_gru(part.head)(drafter.embed_weight[tokens])[0]
        base = hidden @ drafter.head_weight.T
        final = base + (torch.arange(4) >= 1)[None, :, None] * part.head.embed_proj(torch.cat([hidden, s], -1))
        w, y = out.weights, out.labels
        ce_f, ce_b = (F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").view(-1, 4)
                      for z in (final, base))
        torch.testing.assert_close(out.loss, (w * (0.7 * ce_f + 0.3 * ce_b)).sum() / w.sum())
        torch.testing.assert_close(out.parts["domino"].logs["domino/ce"], (w * ce_f).sum() / w.sum())
        torch.testing.assert_close(out.parts["domino"].logs["domino/base_ce"], (w * ce_b).sum() / w.sum())
        assert torch.equal(out.topk[..., 0], final.argmax(-1))  # the module's accuracy and tau: what is served
        assert torch.equal(out.parts["domino"].rows, torch.stack([final.argmax(-1) == y, base.argmax(-1) == y], -1))


def domino_module(tiny_target, settings: DominoSettings | None = None, **kw):
    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.module import DFlashModule

    cfg = DrafterConfig(num_layers=2, block_size=4, variant="domino",
                        domino=settings or DominoSettings(gru_hidden_dim=8, emb_dim=4))
    return DFlashModule(str(tiny_target), cfg, token_budget=64, num_anchors=8,
                        **{"objective": "ce", "loss_weights": "decay", **kw})


def test_the_run_is_checked_and_lambda_fed_each_step_from_the_module(tiny_target):
    """check_run: another loss refused when the module is built, a run with no end when fitting starts (one line,
    never lambda silently 0), unless the curriculum is off; each training step sets lambda of the Trainer's step and
    total in place (the same 0-dim tensor, so a compiled loop never recompiles) and logs it as domino/lambda."""
    from test_module import batch_with_features

    for kw, message in (({"loss_weights": "dpace"}, "model.loss_weights=decay"), ({"objective": "kl"},
                                                                                   "model.objective=ce")):
        with pytest.raises(ConfigError, match=message):
            domino_module(tiny_target, **kw)
    module = domino_module(tiny_target, metrics_every=1)
    module.configure_model()
    module._trainer = SimpleNamespace(estimated_stepping_batches=math.inf, global_step=0, global_rank=0)
    with pytest.raises(ConfigError, match=r"^model.drafter.domino.lambda_base_start=1.0: the base-to-final curriculum "
                                          r"falls over the run's total optimizer steps, and this run has no end; .*"
                                          r"lambda_base_start=0 to train the final loss alone$"):
        module.configure_optimizers()
    off = domino_module(tiny_target, DominoSettings(gru_hidden_dim=8, emb_dim=4, lambda_base_start=0.0))
    off.check_parts(math.inf)  # no curriculum: the part needs no total (the learning rate's schedule still does)
    module._trainer.estimated_stepping_batches = 10
    module.configure_optimizers()
    lam = module.drafter.parts[0].curriculum.lam
    batch = batch_with_features(tiny_target, module.drafter_config.target_layer_ids)
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, value)
    for step in (0, 4, 12):
        module._trainer.global_step = step
        module.training_step(batch, 0)
        assert logged["train/domino/lambda"].item() == pytest.approx(max(0.0, 1 - step / 10))
        assert module.drafter.parts[0].curriculum.lam is lam


def test_compiled_domino_step_equals_the_eager_one_without_recompiling(tiny_target, monkeypatch):
    """`model.compile` compiles the layers, the head loop with the correction and the GRU states
    (`Part.compile_hooks`): the same loss and gradients as eager, and steps of other anchors and another lambda reuse
    the graphs (lambda is the same 0-dim tensor, set in place). Traced through AOT autograd without inductor's code
    generation (2 minutes on 2 CPU cores; test_module compiles a step with it)."""
    import functools

    from test_module import batch_with_features
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    modules = []
    for compile in (False, True):
        torch.manual_seed(0)
        module = domino_module(tiny_target, compile=compile)
        module.configure_model()
        modules.append(module)
    eager, compiled = modules
    compiled.load_state_dict(eager.state_dict())
    batch = batch_with_features(tiny_target, eager.drafter_config.target_layer_ids)
    counters.clear()
    for seed, step in ((3, 0), (4, 3)):
        outs = []
        for m in (eager, compiled):
            m.drafter.parts[0].set_step(step, 6)
            outs.append(m.step(batch, generator=torch.Generator().manual_seed(seed)))
            m.drafter.zero_grad()
            outs[-1].loss.backward()
        torch.testing.assert_close(outs[0].loss, outs[1].loss, rtol=1e-5, atol=1e-5)
        for name in ("embed_proj.2.weight", "prefix_gru.weight_hh_l0", "fc.weight"):
            grads = [m.drafter.get_parameter(name).grad for m in (eager, compiled)]
            torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    assert compiled.drafter.parts[0].prefix_states is not eager.drafter.parts[0].prefix_states
    assert not counters["recompiles"] and not counters["graph_break"], dict(counters)


def stepped(tiny_target, **kw):
    """A built Domino module at step 1 of 4 (lambda 0.75)."""
    torch.manual_seed(0)
    module = domino_module(tiny_target, **kw)
    module.configure_model()
    module.drafter.parts[0].set_step(1, 4)
    return module


def test_bf16_compute_follows_the_fp32_step(tiny_target):
    """The module's step of a Domino drafter under bf16 autocast over fp32 weights (bf16-mixed) stays near the fp32
    step, with fp32 gradients of the GRU and the projector."""
    from test_module import batch_with_features

    module = stepped(tiny_target)
    batch = batch_with_features(tiny_target, module.drafter_config.target_layer_ids)
    reference = module.step(batch, generator=torch.Generator().manual_seed(1)).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module.step(batch, generator=torch.Generator().manual_seed(1)).loss
    loss.backward()
    for w in (module.drafter.embed_proj[2].weight, module.drafter.prefix_gru.weight_hh_l0):
        assert w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0
    torch.testing.assert_close(loss.float(), reference, rtol=2e-2, atol=0)


@pytest.mark.skipif(not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm", "CPU"),
                    reason="no CPU kernel of aten::_scaled_mm (FP8 matmul) in this torch: FP8 runs on Hopper GPUs")
def test_fp8_follows_the_bf16_step(tiny_target, monkeypatch):
    """`model.fp8=all` (torchao's CPU path): the loss near the bf16 one; the projector's weights, read by hand, get
    their gradients."""
    pytest.importorskip("torchao")
    from test_module import batch_with_features

    monkeypatch.setattr("dflash_lightning.module_settings.require_fp8", lambda *args: None)
    losses, state, batch = [], None, None
    for fp8 in ("none", "all"):
        module = stepped(tiny_target, fp8=fp8)
        state = state or module.state_dict()
        module.load_state_dict(state)
        module.to(torch.bfloat16)
        batch = batch or batch_with_features(tiny_target, module.drafter_config.target_layer_ids)
        out = module.step(batch, generator=torch.Generator().manual_seed(1))
        out.loss.backward()
        assert module.drafter.embed_proj[0].weight.grad.abs().sum() > 0
        losses.append(out.loss.float())
    assert module.drafter.head_fp8 is not None and not torch.equal(*losses)  # FP8 did run
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=0)


def test_export_writes_sglangs_bf16_folder_and_says_vllm_has_no_runtime(tiny_target, tmp_path, capsys):
    """`export` of a Domino checkpoint: bf16 weights whatever it trained in (another dtype asked for is refused in
    one line), the SGLang command (DFLASH, the block size, the candidate pool when not SGLang's), no vLLM command and
    the reason; the folder imports back as Domino, and the transformers modelling file refuses it by name."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    from dflash_lightning.commands.export import export
    from dflash_lightning.folder.reader import import_folder
    from dflash_lightning.hf.modeling_dflash import DFlashDraftModel
    from dflash_lightning.parts.domino import VLLM_NOTE

    module = domino_module(tiny_target, DominoSettings(gru_hidden_dim=8, emb_dim=4, candidate_pool_size=0))
    module.configure_model()
    ckpt = {"state_dict": module.state_dict(), "drafter_config": module.drafter_config.to_dict(), "global_step": 1,
            "hyper_parameters": {"target": str(tiny_target)}, "precision": "32-true"}
    torch.save(ckpt, tmp_path / "last.ckpt")
    with pytest.raises(ConfigError, match="^dtype float32: a domino drafter's folder is served only in bfloat16 .*"):
        export(checkpoint=str(tmp_path / "last.ckpt"), out=str(tmp_path / "f32"), dtype="float32")
    folder = export(checkpoint=str(tmp_path / "last.ckpt"), out=str(tmp_path / "folder"))
    printed = capsys.readouterr().out
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["DFlashDraftModel"]
    assert {v.dtype for v in load_file(folder / "model.safetensors").values()} == {torch.bfloat16}
    assert "vllm serve" not in printed and f"\n{VLLM_NOTE}\n" in printed
    assert (f"--speculative-algorithm DFLASH --speculative-draft-model-path {folder} --speculative-dflash-block-size 4 "
            f"--dtype bfloat16 --speculative-domino-candidate-pool-size 0\n") in printed
    cfg, state = import_folder(folder)
    assert cfg.variant == "domino" and cfg.domino == DominoSettings(gru_hidden_dim=8, emb_dim=4)
    assert set(state) == set(module.drafter.state_dict())
    with pytest.raises(ValueError, match="projector_type 'domino': this file builds plain DFlash drafters"):
        DFlashDraftModel(Qwen3Config(**config))
    config["emb_dim"] = 5  # SGLang refuses a folder whose two emb_dims differ; so does import
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"dflash_config.emb_dim \(4\) and the top-level emb_dim \(5\) differ"):
        import_folder(folder)


def sglang_served_dtype(flag: str | None, config_dtype: str | None) -> str:
    """The dtype SGLang 0.5.23 builds a model in (read from model_config.py's `_get_and_verify_dtype`): `--dtype X`
    gives X; `auto`, the default, gives the config.json's dtype, float16 for float32 or none (Gemma aside)."""
    if flag not in (None, "auto"):
        return flag
    return "float16" if config_dtype in (None, "float32") else config_dtype


def folder_config(b: int = 6, v: int = 300) -> DrafterConfig:
    """A tiny Domino drafter's config (the target's sizes as `sglang_case`'s inputs)."""
    return DrafterConfig(num_layers=1, block_size=b, mask_token_id=v - 1, target_layer_ids=[0, 2], hidden_size=H,
                         intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, vocab_size=v,
                         num_target_layers=4, variant="domino", domino=DominoSettings(gru_hidden_dim=G, emb_dim=E))


def sglang_dtype_flag(command: str) -> str | None:
    """The `--dtype` of a launch command; None: not given."""
    args = shlex.split(command)
    return args[args.index("--dtype") + 1] if "--dtype" in args else None


@pytest.mark.parametrize("target_dtype", ["float32", "float16", "bfloat16", None])
def test_the_printed_sglang_command_starts_domino_on_any_target_dtype(target_dtype):
    """One `--dtype` serves SGLang's target and drafter, and its Domino runtime (`validate_domino_runtime`) starts only
    with the target's embedding and head and the projector's weights in bf16: the printed command serves both so,
    whatever dtype the target's config.json names (under `auto` a float32 or float16 target is served in float16)."""
    from dflash_lightning.folder.serve import serve_commands

    flag = sglang_dtype_flag(serve_commands("folder", folder_config(), "target")["sglang"])
    assert sglang_served_dtype(flag, target_dtype) == "bfloat16"  # the target's embedding and head
    assert sglang_served_dtype(flag, FOLDER_DTYPE) == "bfloat16"  # the drafter's projector


# ---- SGLang's own Domino code ---------------------------------------------------------------------------------------

ENGINE = os.environ.get("DFLASH_ENGINE_PYTHON", "")


def sglang_case(seed: int = 0) -> tuple[dict, dict]:
    """A Domino drafter's folder as export writes it (config.json of the preset, a tiny backbone plus the part, bf16
    as SGLang wants), inputs for a few blocks, and the part's own drafts on them (`DominoCorrection.draft`, block by
    block, from the folder's weights), in fp32 and in bf16 (as SGLang serves), by pool size."""
    from dataclasses import replace

    from dflash_lightning.folder.codec import hf_config
    from dflash_lightning.folder.serve import serve_commands
    from dflash_lightning.model import DFlashDrafter
    from dflash_lightning.parts.base import DraftInputs

    b, v = 6, 300
    cfg = folder_config(b, v)
    config = hf_config(cfg, FOLDER_DTYPE)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    part = drafter.parts[0]
    part.head.load_state_dict(domino(seed, v=v).float().state_dict())
    state = {k: w if part.owns(k) else torch.randn_like(w) for k, w in drafter.state_dict().items()}  # no two alike
    weights = {k: w.bfloat16() for k, w in state.items()}
    drafter.load_state_dict({k: w.float() for k, w in weights.items()})  # what the folder holds
    g = torch.Generator().manual_seed(seed + 1)
    inputs = {"hidden": torch.randn(5, b, H, generator=g) * 2, "first": torch.randint(0, v, (5,), generator=g),
              "embed": torch.randn(v, H, generator=g), "head": torch.randn(v, H, generator=g) / H**0.5}
    pools, ours = [0, 16], {}
    for dtype, key in ((torch.float32, "drafts"), (torch.bfloat16, "drafts_bf16")):
        part.head.to(dtype)
        hidden, head, embed = (inputs[k].to(dtype) for k in ("hidden", "head", "embed"))
        ours[key] = {}
        for pool in pools:
            part.settings = replace(part.settings, candidate_pool_size=pool)
            drafts = [part.draft(DraftInputs(hidden[i, : b - 1], hidden[i, : b - 1] @ head.T, inputs["first"][i], None,
                                             embed, 0.0, None, hidden[i])) for i in range(5)]
            assert all(d.q is None for d in drafts)  # a point mass: no engine samples Domino drafts
            ours[key][pool] = torch.stack([d.tokens for d in drafts])
    flag = sglang_dtype_flag(serve_commands("folder", cfg, "target")["sglang"]) or "auto"  # the printed, then auto
    dtypes = [(given, dtype) for given in (flag, "auto") for dtype in ("float32", "float16", "bfloat16", None)]
    return {"config": config, "weights": weights, "inputs": inputs, "pools": pools, "dtypes": dtypes}, ours


@pytest.mark.skipif(not ENGINE, reason="no engine venv: $DFLASH_ENGINE_PYTHON is not set (tools/engine_venv.sh)")
def test_sglang_loads_our_folder_and_drafts_our_tokens(tmp_path):
    """SGLang 0.5.23's own DFlashDraftModel, built on the CPU from our config.json, loads every weight of our folder
    (no missing parameter, no tensor left out), parses Domino's fields as ours, and its domino_greedy_rollout drafts
    our greedy tokens on the same inputs, with the full vocabulary and with a candidate pool, in fp32 and in bf16; its
    dtype rule and validate_domino_runtime accept the printed command's --dtype on a target of any dtype."""
    case, ours = sglang_case()
    torch.save([case], tmp_path / "in.pt")
    done = subprocess.run([ENGINE, str(Path(__file__).with_name("domino_engines.py")), str(tmp_path / "in.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    (theirs,) = torch.load(tmp_path / "out.pt")
    assert not theirs["missing"] and not theirs["unexpected"], theirs
    assert theirs["parsed"] == {"projector_type": "domino", "shift_label": True, "pure_draft_prefix_len": 1,
                                "gru_hidden_dim": G, "emb_dim": E}
    for key in ("drafts", "drafts_bf16"):
        for pool in case["pools"]:
            assert torch.equal(theirs[key][pool], ours[key][pool]), (key, pool)
    # the printed command starts on a target of any dtype; `auto` (no --dtype) only on a bf16 one
    flag = case["dtypes"][0][0]
    for (given, dtype), refusal in theirs["starts"].items():
        assert (refusal is None) == (given == flag or dtype == "bfloat16"), (given, dtype, refusal)
