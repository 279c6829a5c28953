"""The chunked head loop's part interface (loss.py, parts/base.py) against dense autograd references: a correction
of the logits with the base logits kept for a second objective, inputs with a gradient, per-block inputs, an
objective weight of 0 the loop does not compute, and a part's own denominator."""

from __future__ import annotations

import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dflash_lightning.loss import LossSettings, chunked_head_loss
from dflash_lightning.parts.base import ChunkResult, Correction, HeadChunk, Part

H, G, V, B = 8, 5, 30, 4
DECAY = LossSettings(loss_weights="decay")


class ToyCorrection(Part):
    """c = W [h; s] on the rows `keep` marks, f = b + c: Domino's shape of correction, written small."""

    name = "toy"
    top_k = 1
    head_rows = 1

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__(SimpleNamespace(toy=None))
        self.w = nn.Parameter(torch.randn(V, H + G, dtype=torch.float64) * 0.5)
        self.weight = weight

    def objective_weight(self) -> float:
        return self.weight

    def head_params(self) -> tuple[Tensor, ...]:
        return (self.w,)

    def logit_correction(self, rows: tuple[Tensor, ...], hidden: Tensor, like: Tensor) -> Correction:
        states, keep, lam = rows
        x = torch.cat([hidden, states.to(hidden.dtype)], -1) * keep[:, None]
        return Correction(F.linear(x, self.w.to(x.dtype)).to(like.dtype), lam)

    def head_chunk(self, chunk: HeadChunk) -> ChunkResult:
        states, keep, _ = chunk.rows
        assert chunk.logits is None  # turned into d/dc in place
        x = torch.cat([chunk.hidden, states.to(chunk.hidden.dtype)], -1) * keep[:, None]
        dc = chunk.d_correction.mul_(chunk.weights[:, None])  # [R, V] weighted, in place: the loop frees it next
        chunk.grads[0].add_(dc.T @ x)
        dx = (dc @ self.w.to(dc.dtype)) * keep[:, None]  # [R, H + G]
        right = torch.stack([chunk.top_ids[:, 0] == chunk.labels, chunk.base_ids == chunk.labels], -1)
        return ChunkResult(logged=(chunk.weights * chunk.base_ce).sum(), grad_hidden=dx[:, :H],
                           grad_inputs=(dx[:, H:],), rows=(right,))


def dense_correction(hidden, head, labels, weights, states, keep, lam, w, scale):
    """(1 - lambda) CE(f) + lambda CE(b) on whole logits, with autograd's gradients; and f, b."""
    b = hidden @ head.T
    f = b + (torch.cat([hidden, states], -1) * keep[:, None]) @ w.T
    ce_f, ce_b = (F.cross_entropy(z, labels, reduction="none") for z in (f, b))
    total = scale * (weights * ((1 - lam) * ce_f + lam * ce_b)).sum()
    return total, f, b, ce_f, ce_b


def toy_rows(n: int, seed: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, dtype=torch.float64, generator=g).requires_grad_()
    head = torch.randn(V, H, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (n,), generator=g)
    weights = torch.rand(n, dtype=torch.float64, generator=g) * (torch.rand(n, generator=g) > 0.3)
    states = torch.randn(n, G, dtype=torch.float64, generator=g).requires_grad_()
    keep = (torch.arange(n) % B != 0).double()  # slot 0 keeps the base logits, as Domino's first slot
    return hidden, head, labels, weights, states, keep


@pytest.mark.parametrize(("lam", "scale", "chunk"), [
    (0.3, 1.0, 2 * B), (0.0, 1.0, 3 * B), (1.0, 0.5, 100), (0.7, 0.0, B),  # chunk 100: every row at once
])
def test_a_correction_trains_f_and_b_and_serves_f(lam, scale, chunk):
    """f = b + c served (top-k, CE, argmax) and trained with (1 - lambda) CE(f) + lambda CE(b), lambda a 0-dim tensor;
    the gradients to the rows' hidden states, to an input that requires one (the states) and to the part's weight
    equal autograd's through the whole logits; the base CE and argmax reach head_chunk."""
    part = ToyCorrection(scale)
    hidden, head, labels, weights, states, keep = toy_rows(6 * B, seed=1)
    lam_t = torch.tensor(lam, dtype=torch.float64)
    total, ce, used, top, [(logged, (right,))] = chunked_head_loss(
        hidden, head, labels, weights, chunk, 3, B, DECAY, parts=((part, (states, keep, lam_t)),))
    grads = torch.autograd.grad(total * 3, [hidden, states, part.w], allow_unused=True)
    ref, f, b, ce_f, ce_b = dense_correction(hidden, head, labels, weights, states, keep, lam, part.w, scale)
    torch.testing.assert_close(total, ref)
    torch.testing.assert_close(ce, (weights * ce_f).sum())
    torch.testing.assert_close(logged, (weights * ce_b).sum())
    torch.testing.assert_close(used, weights)
    assert torch.equal(top, f.topk(3, -1).indices)
    assert torch.equal(right, torch.stack([f.argmax(-1) == labels, b.argmax(-1) == labels], -1))
    if scale == 0:
        assert all(g is None or not g.any() for g in grads)
        return
    ref_grads = torch.autograd.grad(ref * 3, [hidden, states, part.w])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


class LiveRows(TorchDispatchMode):
    """The most storages of at least `numel` elements alive at once (the inputs' aside)."""

    def __init__(self, numel: int, inputs: list[Tensor]) -> None:
        super().__init__()
        self.numel, self.live, self.peak = numel, [], 0
        self.inputs = {x.untyped_storage().data_ptr() for x in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, Tensor) and x.numel() >= self.numel:
                self.live.append(weakref.ref(x))
        alive = {r().untyped_storage().data_ptr() for r in self.live if r() is not None} - self.inputs
        self.peak = max(self.peak, len(alive))
        return out


def test_a_correction_holds_two_rows_by_vocabulary_buffers():
    """f and b, each turned into its softmax and gradient in place, and no chunk's buffers alive into the next
    chunk's: at most two [rows, V] tensors at any op (V large beside the other widths, as 151936 is)."""
    part = ToyCorrection()
    hidden, head, labels, weights, states, keep = toy_rows(12 * B, seed=8)
    head = torch.randn(600, H, dtype=torch.float64)
    part.w = nn.Parameter(torch.randn(600, H + G, dtype=torch.float64))
    labels = labels * 19
    watch = LiveRows(4 * B * 600, [hidden, states, head, part.w])  # beyond [V, H + G]: the weights and theirs
    with watch, torch.no_grad():
        chunked_head_loss(hidden, head, labels, weights, 4 * B, 0, B, DECAY,
                          parts=((part, (states, keep, torch.tensor(0.3))),))
    assert watch.peak == 2


def test_a_correcting_part_works_alone_under_the_ce():
    part = ToyCorrection()
    hidden, head, labels, weights, states, keep = toy_rows(2 * B, seed=2)
    inputs = (states, keep, torch.tensor(0.5))
    with pytest.raises(ValueError, match="works alone in the head loop"):
        chunked_head_loss(hidden, head, labels, weights, 8, 0, B, DECAY,
                          parts=((part, inputs), (ToyCorrection(), inputs)))
    with pytest.raises(ValueError, match="under the CE only"):
        chunked_head_loss(hidden, head, labels, weights, 8, 0, B, LossSettings("kl", "decay"), hidden,
                          torch.arange(2 * B), parts=((part, inputs),))


class ToyBlocks(Part):
    """XPress's shape of part: the loop's own objective weighted 0; a per-block input with a gradient `u [A, K]`
    and per-block tokens `[A, B]`; its term CE(b + u P, the block's token at the slot), made by hand."""

    name = "toy"
    head_rows = 1

    def __init__(self) -> None:
        super().__init__(SimpleNamespace(toy=None))
        self.p = nn.Parameter(torch.randn(3, V, dtype=torch.float64))
        self.seen_d_logits: list[Tensor] = []

    def objective_weight(self) -> float:
        return 0.0

    def head_params(self) -> tuple[Tensor, ...]:
        return (self.p,)

    def head_chunk(self, chunk: HeadChunk) -> ChunkResult:
        u, tokens = chunk.rows  # [n, K], [n, B]: the chunk's blocks
        self.seen_d_logits.append(chunk.d_logits.clone())
        u_rows = u.repeat_interleave(B, 0)  # [R, K]
        z = chunk.logits + u_rows @ self.p
        target = tokens.flatten()
        ce = F.cross_entropy(z, target, reduction="none")
        dz = torch.softmax(z, -1) - F.one_hot(target, V)  # no exp or scatter of its own: the test counts the loop's
        chunk.d_logits.add_(dz)  # before the weights, as the loop's own gradient
        dz = dz * chunk.weights[:, None]
        chunk.grads[0].add_(u_rows.T @ dz)
        du = (dz @ self.p.T).view(-1, B, u.shape[1]).sum(1)  # [n, K]
        return ChunkResult(loss=(chunk.weights * ce).sum(), grad_inputs=(du, None), rows=(target,))


class AtenOps(TorchDispatchMode):
    """Records (op, output shape) of every aten call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor):
            self.calls.append((str(func.overloadpacket), tuple(out.shape)))
        return out


def test_per_block_inputs_and_a_zero_objective_weight():
    """Per-block inputs come sliced by whole blocks (a gradient to the one that requires it, per block); with the
    loop's objective weighted 0 the parts' gradient starts at zero and no softmax of the loop's own is made."""
    part = ToyBlocks()
    a = 5
    hidden, head, labels, weights, _, _ = toy_rows(a * B, seed=3)
    g = torch.Generator().manual_seed(4)
    u = torch.randn(a, 3, dtype=torch.float64, generator=g).requires_grad_()
    tokens = torch.randint(0, V, (a, B), generator=g)
    with AtenOps() as ops:
        total, _, _, _, [(_, (seen,))] = chunked_head_loss(hidden, head, labels, weights, 2 * B, 0, B, DECAY,
                                                           parts=((part, (u, tokens)),))
    assert torch.equal(seen, tokens.flatten())  # the blocks of each chunk, in order
    assert all(not d.any() for d in part.seen_d_logits) and len(part.seen_d_logits) == 3
    rows_v = [(op, shape) for op, shape in ops.calls if shape[-1:] == (V,) and len(shape) == 2]
    assert not [c for c in rows_v if c[0] in ("aten.exp", "aten.exp_", "aten.scatter_add_", "aten.scatter_add")]
    grads = torch.autograd.grad(total * 2, [hidden, u, part.p])
    z = hidden @ head.T + u.repeat_interleave(B, 0) @ part.p
    ref = (weights * F.cross_entropy(z, tokens.flatten(), reduction="none")).sum()
    ref_grads = torch.autograd.grad(ref * 2, [hidden, u, part.p])
    torch.testing.assert_close(total, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_a_head_input_of_another_length_is_refused():
    hidden, head, labels, weights, _, _ = toy_rows(3 * B, seed=5)
    with pytest.raises(ValueError, match="neither per row"):
        chunked_head_loss(hidden, head, labels, weights, 8, 0, B, DECAY,
                          parts=((ToyBlocks(), (torch.zeros(7, 3), torch.zeros(3, B, dtype=torch.long))),))


def test_the_correction_compiles_once_for_every_lambda():
    """As `compile_blocks` compiles the loop: one graph for two steps with other lambdas (0-dim tensors), labels and
    weights; no recompile, no graph break, no host sync; equal to the eager loop."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    part = ToyCorrection()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(chunked_head_loss, backend=backend, fullgraph=True, dynamic=False)
    counters.clear()
    for seed, lam in ((6, 0.9), (7, 0.2)):
        hidden, head, labels, weights, states, keep = toy_rows(4 * B, seed)
        args = (hidden, head, labels, weights, 2 * B, 2, B, DECAY)
        inputs = (states, keep, torch.tensor(lam, dtype=torch.float64))
        total, *_ = compiled(*args, parts=((part, inputs),))
        ref, *_ = chunked_head_loss(*args, parts=((part, inputs),))
        torch.testing.assert_close(total, ref)
        total.backward()
    assert len(graphs) == 1 and not counters["recompiles"] and not counters["graph_break"]
    sync_ops = ("item", "tolist", torch.ops.aten._local_scalar_dense.default)
    assert not [node for node in graphs[0].graph.nodes if node.target in sync_ops]


def test_a_parts_denominator_divides_the_steps_loss(monkeypatch):
    """`Part.loss_denominator` replaces the weight sum as what the step's loss (and the part's logged sums) are
    divided by; the logged CE stays over the weight sum."""
    from helpers import packed_batch
    from test_model import tiny_drafter

    from dflash_lightning.blocks import select_anchors, slot_weights
    from dflash_lightning.model import DFlashDrafter
    from dflash_lightning.parts import presets

    class Counted(Part):
        name = "selector"  # any DrafterConfig field: the part reads no settings
        weight_prefix = "counted"

        def head_inputs(self, batch):
            return ()

        def head_chunk(self, chunk):
            return ChunkResult(logged=chunk.weights.sum())

        def loss_denominator(self, batch):
            return 2.0 * batch.supervised.sum()

    monkeypatch.setitem(presets.PRESETS, "dflash2", presets.Preset((Counted,), "DFlash2DraftModel"))
    plain = tiny_drafter(block=4)
    drafter = DFlashDrafter(replace(plain.config, variant="dflash2")).double()
    drafter.load_state_dict(plain.state_dict())
    drafter.set_target_io(plain.embed_weight, plain.head_weight)
    drafter.loss_settings = plain.loss_settings
    batch = packed_batch([20, 12], 40, seed=2)
    features = torch.randn(40, 96, dtype=torch.float64)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 8, torch.Generator().manual_seed(3))
    args = (features, batch["input_ids"], batch["position_ids"], batch["doc_ids"], batch["loss_mask"], anchors, valid,
            slot_weights(4, 4.0).double())
    ours, ref = drafter(*args), plain(*args)
    count = 2.0 * ref.supervised.sum()
    torch.testing.assert_close(ours.loss, ref.loss * ref.weights.sum() / count)
    torch.testing.assert_close(ours.ce, ref.ce)
