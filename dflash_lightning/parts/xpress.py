"""XPress (docs/method.md section 14): a causal low-rank refiner whose output is a logit bias on each slot of a
section-3 block, trained with a teacher-forced pass, consistency rounds on its own argmax and a base term, and
resolved at decoding by K parallel Jacobi passes.

Shapes: N blocks, B slots (slot 0 the anchor, slots 1..B-1 draft), H the drafter's width, r the refiner's rank, M
its MLP width, V the vocabulary, R rows (slots 1..B-1 of whole blocks, flattened). This file holds the refiner
module (`XPressHead`, placed at `xpress_head` with the folder's weight names), its settings, the chunked training
loss with hand-made gradients, the Jacobi drafting rule, and the mapping to the folder vLLM 0.34 serves and from
speculators' own `xpress` folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric

from dflash_lightning.blocks import BlockLayout, slot_weights
from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.base import (
    ChunkResult,
    Draft,
    DraftInputs,
    HeadChunk,
    HeadOutput,
    Part,
    PartOutput,
    TrainInputs,
)

PREFIX = "xpress_head."
"""Where every weight of the refiner sits, in the drafter and in the folder."""
VLLM_ARCHITECTURE = "Qwen3XPressModel"
"""config.json's `architectures` entry of the folder vLLM 0.34 serves (Model Runner V2, `qwen3_xpress.py`)."""
VLLM_DEFAULTS = {"xpress_rank": 256, "xpress_mlp_hidden": 512, "xpress_num_passes": 6, "xpress_topc": 512}
"""What vLLM 0.34 reads where a folder's config.json lacks the field (`Qwen3XPressModel`, `XPressSpeculator`)."""
FILL_IN_GAMMA_4 = BlockLayout(gamma=4.0)
"""Section 14's block: section 3's fill-in layout (slots 1..B-1 predict p + k and draft), slot weights
exp(-(k-1)/4) unless `model.drafter.gamma` is set."""


@dataclass
class XPressSettings:
    """The refiner's shape and decoding (config.json `xpress_*`, read by vLLM) and its loss weights
    (`model.drafter.xpress.*`, training choices a folder does not carry)."""

    rank: int = 256
    """r: width of the refiner's token embedding, projections, causal mixer and MLP, a power of two >= 16
    (config.json xpress_rank)."""
    mlp_hidden: int = 512
    """M: hidden width of the refiner's SwiGLU MLP, a multiple of 64; 2 r in the recipe (config.json
    xpress_mlp_hidden)."""
    num_passes: int = 6
    """K: Jacobi passes that resolve a block at decoding; after pass t the first t drafts are final
    (config.json xpress_num_passes)."""
    topc: int = 0
    """Candidates per slot each Jacobi pass scores: the top C of the slot's base logits; 0 scores the full
    vocabulary, the training semantics (config.json xpress_topc; vLLM serves 512 where a folder has none)."""
    sampled_drafts: bool = False
    """At temperature > 0, draft as the xPress harness does (one Gumbel draw a block shared by all passes, q =
    softmax(last pass / T)); false: the greedy Jacobi block as point masses, as vLLM 0.34 serves it."""
    consistency_rounds: int = 3
    """R: training passes fed the previous pass's detached argmax (the first from the base logits' argmax)."""
    consistency_weight: float = 0.3
    """Weight of the mean of the consistency rounds' losses."""
    base_weight: float = 0.6
    """Weight of the base term, the loss of the backbone's own logits head(h) (keeps the Jacobi seed good)."""
    ce_weight: float = 0.1
    """Weight of the CE against the target's argmax inside each term."""
    tv_weight: float = 0.9
    """Weight of the total variation distance to the target's distribution inside each term."""
    prev0: Literal["previous", "anchor"] = "previous"
    """Training's prev_0, the token the refiner reads at slot 0: `previous`, the token before the anchor in its
    document (section 14, speculators; the anchor's own at a document's start), or `anchor`, the anchor's token,
    which is what vLLM 0.34 feeds when it serves."""

    def check(self, config: Any) -> None:
        """Raise ConfigError naming the field of a value that cannot work for the drafter `config`."""
        for name in ("rank", "mlp_hidden", "num_passes"):
            if not getattr(self, name) >= 1:
                raise ConfigError(f"xpress.{name} must be >= 1, got {getattr(self, name)}")
        # vLLM 0.34's Jacobi kernel (spec_decode/xpress/kernels.py) tiles the rank by tl.arange and tl.dot, the MLP by
        # 64 columns with no mask: another shape reads past its weights there
        if self.rank < 16 or self.rank & (self.rank - 1):
            raise ConfigError(f"xpress.rank must be a power of two >= 16 (vLLM's Jacobi kernel), got {self.rank}")
        if self.mlp_hidden % 64:
            raise ConfigError(f"xpress.mlp_hidden must be a multiple of 64 (vLLM's Jacobi kernel), got "
                              f"{self.mlp_hidden}")
        vocab = getattr(config, "vocab_size", None)  # None until the target's config is read
        if not 0 <= self.topc <= (vocab or self.topc):
            top = f"vocab_size ({vocab})" if vocab else "vocab_size"
            raise ConfigError(f"xpress.topc must be in 0..{top} (0: the full vocabulary), got {self.topc}")
        if not self.consistency_rounds >= 0:
            raise ConfigError(f"xpress.consistency_rounds must be >= 0, got {self.consistency_rounds}")
        for name in ("consistency_weight", "base_weight", "ce_weight", "tv_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"xpress.{name} must be >= 0, got {getattr(self, name)}")
        if not (self.ce_weight or self.tv_weight):
            raise ConfigError("xpress: ce_weight and tv_weight are both 0, so nothing would train; set one above 0")
        if self.prev0 not in ("previous", "anchor"):
            raise ConfigError(f"xpress.prev0 must be 'previous' or 'anchor', got {self.prev0!r}")
        if getattr(config, "block_size", 2) < 2:
            raise ConfigError(f"block_size must be >= 2 for XPress (slot 0 is the anchor), got {config.block_size}")


# ---- the refiner ------------------------------------------------------------------------------------------------
def mix_blocks(mix: Tensor, a: Tensor) -> Tensor:
    """c[n, k, r] = sum_j mix[r, k, j] a[n, j, r]: each channel's block mix, as one matmul batched over the channels.
    Its operands are made contiguous: the CPU's batched matmul of strided ones (an einsum's views) is 100x slower.
    # [N, B, r]"""
    return torch.bmm(mix, a.permute(2, 1, 0).contiguous()).permute(2, 1, 0).contiguous()


def mix_grad(dc: Tensor, a: Tensor) -> Tensor:
    """d loss / d mix[r, k, j] = sum_n dc[n, k, r] a[n, j, r] of `mix_blocks`.  # [r, B, B]"""
    return torch.bmm(dc.permute(2, 1, 0).contiguous(), a.permute(2, 0, 1).contiguous())


class CausalMix(nn.Module):
    """Per-channel causal token mix of a block, c_k = a_k + sum_{j<=k} L[:, k, j] a_j, with L stored raw (its upper
    triangle unused): the folder's `mix.L`, which vLLM folds into `L * tril + I` when it loads it."""

    def __init__(self, rank: int, block_size: int) -> None:
        super().__init__()
        self.L = nn.Parameter(torch.zeros(rank, block_size, block_size))  # [r, B, B]
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)), persistent=False)

    def folded(self, dtype: torch.dtype) -> Tensor:
        """L * tril + I, the mix as one matrix per channel.  # [r, B, B]"""
        eye = torch.eye(self.L.shape[-1], dtype=dtype, device=self.L.device)
        return self.L.to(dtype) * self.tril.to(dtype) + eye

    def forward(self, a: Tensor) -> Tensor:
        """`a [N, B, r]` mixed causally over the block.  # [N, B, r]"""
        return mix_blocks(self.folded(a.dtype), a)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (the folder's `mlp.{gate,up,down}_proj`)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class XPressHead(nn.Module):
    """The refiner (`xpress_head.*`): for backbone outputs h [N, B, H] (after `norm`) and the previous-token ids
    prev [N, B], refined_k = head(h_k) + w2(x_k) with g = mean_k h_k, a_k = in_proj([down_h h_k; down_g g;
    w1[prev_k]]), c = mix(a) (causal over the block), x = c + mlp(c)."""

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, settings: XPressSettings) -> None:
        super().__init__()
        r = settings.rank
        self.block_size = block_size
        self.w1 = nn.Embedding(vocab_size, r)
        self.down_h = nn.Linear(hidden_size, r, bias=False)
        self.down_g = nn.Linear(hidden_size, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix = CausalMix(r, block_size)
        self.mlp = SwiGLU(r, settings.mlp_hidden)
        self.w2 = nn.Linear(r, vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Every weight normal(0, 0.02) and the raw mixer 0 (section 14; speculators and the xPress release): the
        mixer starts as the identity, the refiner as a small bias."""
        for module in (self.w1, self.down_h, self.down_g, self.in_proj, self.mlp.gate_proj, self.mlp.up_proj,
                       self.mlp.down_proj, self.w2):
            nn.init.normal_(module.weight, std=std)
        nn.init.zeros_(self.mix.L)

    def hidden_cache(self, hidden: Tensor) -> Tensor:
        """[down_h h_k; down_g g] of every slot, g the block's mean hidden state: what the passes share.
        # [N, B, 2r]"""
        g = hidden.mean(dim=-2, keepdim=True).expand_as(hidden)
        return torch.cat([self.down_h(hidden), self.down_g(g)], dim=-1)

    def latent(self, prev: Tensor, hcache: Tensor) -> Tensor:
        """x of every slot from the previous-token ids `prev [N, B]` and `hidden_cache`.  # [N, B, r]"""
        a = self.in_proj(torch.cat([hcache, self.w1(prev).to(hcache.dtype)], dim=-1))
        c = self.mix(a)
        return c + self.mlp(c)

    def forward(self, hidden: Tensor, prev: Tensor, head_weight: Tensor) -> Tensor:
        """Refined logits of every slot of blocks `hidden [N, B, H]` with previous tokens `prev [N, B]` through the
        frozen head `[V, H]` (slot 0's are computed and unused).  # [N, B, V]"""
        x = self.latent(prev, self.hidden_cache(hidden))
        return F.linear(hidden, head_weight.to(hidden.dtype)) + self.w2(x)


def teacher_forced_prev(tokens: Tensor, prev0: Tensor) -> Tensor:
    """prev of the teacher-forced pass: [prev_0, t_p, ..., t_{p+B-2}] from the blocks' true tokens `tokens [N, B]`
    (t_p..t_{p+B-1}, slot 0 the anchor's) and `prev0 [N]`.  # [N, B]"""
    return torch.cat([prev0[:, None], tokens[:, :-1]], dim=1)


def drafted_prev(anchor: Tensor, drafts: Tensor, prev0: Tensor) -> Tensor:
    """prev of a pass that reads drafts `[N, B-1]` of slots 1..B-1: [prev_0, x_p, d_1, ..., d_{B-2}].  # [N, B]"""
    return torch.cat([prev0[:, None], anchor[:, None], drafts[:, :-1]], dim=1)


def token_before_anchor(input_ids: Tensor, doc_ids: Tensor, anchors: Tensor) -> Tensor:
    """prev_0 of each block in a packed batch: the token before the anchor where it is in the anchor's document,
    else the anchor's own token (speculators' rule).  # [N]"""
    before = (anchors - 1).clamp(min=0)
    same = (anchors > 0) & (doc_ids[before] == doc_ids[anchors])
    return torch.where(same, input_ids[before], input_ids[anchors])


# ---- decoding: K Jacobi passes ----------------------------------------------------------------------------------
class JacobiDraft(NamedTuple):
    """What `jacobi_draft` returns."""

    tokens: Tensor
    """Drafts of slots 1..B-1.  # [N, B-1]"""
    q: Tensor | None
    """Their draft distributions where sampled (the xPress harness's q), else None: point masses.  # [N, B-1, V]"""
    logits: Tensor
    """The last pass's refined logits of slots 1..B-1 (the base logits after 0 passes).  # [N, B-1, V]"""


def gumbel(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str) -> Tensor:
    """Standard Gumbel noise, fp32: argmax(z / T + noise) is a draw from softmax(z / T).  # shape"""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    e = -torch.log(u.clamp_min(1e-20))  # Exp(1), then Gumbel: two steps, so the clamp binds where meant
    return -torch.log(e.clamp_min(1e-20))


@torch.no_grad()
def jacobi_draft(
    xhead: XPressHead, hidden: Tensor, base: Tensor, anchor: Tensor, num_passes: int, topc: int = 0,
    temperature: float = 0.0, sampled: bool = False, generator: torch.Generator | None = None,
    prev0: Tensor | None = None,
) -> JacobiDraft:
    """Drafts of blocks `hidden [N, B, H]` (the backbone's output after `norm`, every slot) whose slot 0 holds
    `anchor [N]` and whose slots 1..B-1 have the base logits `base [N, B-1, V]` (head(h)), resolved by `num_passes`
    Jacobi passes (vLLM 0.34's `jacobi_refine_greedy`).

    The block starts as each slot's base argmax; every pass recomputes all slots from the previous pass's block
    (prev = [prev_0, x_p, d_1, .., d_{B-2}]) and takes each slot's argmax of its refined logits, so after pass t the
    first t drafts are those of left-to-right greedy decoding. prev_0 is `prev0`, by default the anchor's token as
    vLLM feeds it. `topc` > 0 scores each slot only on its base logits' top C (vLLM's default 512). Sampled
    (`temperature` > 0 and `sampled`): one Gumbel draw a block, shared by the seed and every pass, d_k = argmax(z_k
    / T + noise_k), and q_k = softmax(last pass / T) (over the C candidates with `topc`): the xPress harness's rule,
    under which d_k is a draw from q_k given the earlier slots whatever K is (the mix is causal and the noise of
    slot k is independent of the earlier slots). Otherwise the greedy block, q None (point masses).
    """
    n, b, _ = hidden.shape
    vocab = base.shape[-1]
    dt = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    base = base.to(dt)  # [N, B-1, V]
    wt = xhead.w2.weight.dtype
    hcache = xhead.hidden_cache(hidden.to(wt))  # [N, B, 2r]
    prev0 = anchor if prev0 is None else prev0
    w2 = xhead.w2.weight.to(dt)  # [V, r]
    if topc:
        base, cand = base.topk(min(topc, vocab), dim=-1)  # [N, B-1, C] each
        readout = w2[cand]  # [N, B-1, C, r]
    noise = gumbel(base.shape, generator, base.device).to(dt) if temperature > 0 and sampled else None

    def pick(z: Tensor) -> Tensor:
        idx = (z / temperature + noise if noise is not None else z).argmax(-1)  # [N, B-1]
        return cand.gather(-1, idx[..., None])[..., 0] if topc else idx

    drafts, z = pick(base), base
    for _ in range(num_passes):
        x = xhead.latent(drafted_prev(anchor, drafts, prev0), hcache).to(dt)[:, 1:]  # [N, B-1, r]
        bias = (readout @ x[..., None])[..., 0] if topc else F.linear(x, w2)  # [N, B-1, C or V]
        z = base + bias
        drafts = pick(z)
    q = None
    if noise is not None:
        q = torch.softmax(z / temperature, dim=-1)
        if topc:
            q = torch.zeros(n, b - 1, vocab, dtype=dt, device=z.device).scatter_(-1, cand, q)
    if topc:
        z = torch.full((n, b - 1, vocab), float("-inf"), dtype=dt, device=z.device).scatter_(-1, cand, z)
    return JacobiDraft(drafts, q, z)


# ---- training: the chunked loss with hand-made gradients ----------------------------------------------------------
class LatentGrads(NamedTuple):
    """fp32 accumulators of the gradients of the refiner's weights that the chunks make by hand (down_h and down_g
    are not among them: the hidden cache is made before the chunks, by autograd)."""

    w1: Tensor
    in_proj: Tensor
    mix: Tensor
    gate: Tensor
    up: Tensor
    down: Tensor
    w2: Tensor

    @staticmethod
    def zeros(xhead: XPressHead, dtype: torch.dtype) -> LatentGrads:
        return LatentGrads(*(torch.zeros(p.shape, dtype=dtype, device=p.device) for p in chunk_params(xhead)))


def chunk_params(xhead: XPressHead) -> tuple[Tensor, ...]:
    """The refiner's weights whose gradients the chunks make, in `LatentGrads`' order."""
    return (xhead.w1.weight, xhead.in_proj.weight, xhead.mix.L, xhead.mlp.gate_proj.weight, xhead.mlp.up_proj.weight,
            xhead.mlp.down_proj.weight, xhead.w2.weight)


class _Latent:
    """One pass's latent x = c + mlp(c), c = mix(in_proj([hcache; w1[prev]])), with what its hand-made backward
    needs: the refiner's small forward (rank r), run once per pass and chunk."""

    def __init__(self, weights: tuple[Tensor, ...], prev: Tensor, hcache: Tensor) -> None:
        w1, w_in, mix, w_gate, w_up, w_down, _ = weights
        self.weights, self.prev = weights, prev
        self.inputs = torch.cat([hcache, w1[prev]], dim=-1)  # [n, B, 3r]
        self.a = self.inputs @ w_in.T  # [n, B, r]
        self.tril = torch.tril(torch.ones(mix.shape[-1], mix.shape[-1], dtype=mix.dtype, device=mix.device))
        self.mix = mix * self.tril + torch.eye(mix.shape[-1], dtype=mix.dtype, device=mix.device)  # [r, B, B]
        self.c = mix_blocks(self.mix, self.a)
        self.g, self.u = self.c @ w_gate.T, self.c @ w_up.T  # [n, B, M] each
        self.m = F.silu(self.g) * self.u
        self.x = self.c + self.m @ w_down.T  # [n, B, r]

    def backward(self, dx: Tensor, grads: LatentGrads) -> Tensor:
        """Add the weights' gradients of d loss / dx `[n, B, r]` into `grads`; d loss / d hcache.  # [n, B, 2r]"""
        w1, w_in, _, w_gate, w_up, w_down, _ = self.weights
        r = w_in.shape[0]
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        grads.down.add_(flat(dx).T @ flat(self.m))
        dm = dx @ w_down  # [n, B, M]
        sig = torch.sigmoid(self.g)
        dg = dm * self.u * sig * (1 + self.g * (1 - sig))  # silu'(g) = sig (1 + g (1 - sig))
        du = dm * self.g * sig
        grads.gate.add_(flat(dg).T @ flat(self.c))
        grads.up.add_(flat(du).T @ flat(self.c))
        dc = dx + dg @ w_gate + du @ w_up  # [n, B, r]
        da = mix_blocks(self.mix.transpose(1, 2).contiguous(), dc)  # [n, B, r]
        grads.mix.add_(mix_grad(dc, self.a) * self.tril)
        grads.in_proj.add_(flat(da).T @ flat(self.inputs))
        d_inputs = da @ w_in  # [n, B, 3r]
        grads.w1.index_add_(0, self.prev.flatten(), flat(d_inputs[..., 2 * r:]))
        return d_inputs[..., : 2 * r]


class ChunkTerms(NamedTuple):
    """What `chunk_loss` returns for one chunk of whole blocks: sums over its rows, no normalisation."""

    total: Tensor
    """sum w (C(tf) + consistency_weight mean_j C(round j) + base_weight C(base)): joins the objective's sum."""
    d_hcache: Tensor
    """d total / d hcache of the chunk's blocks (weighted).  # [n, B, 2r]"""
    rows: Tensor
    """Per row, no gradient (`ROW_NAMES`): 1 - TV of the tf pass and of the base logits, whether the argmax of the
    tf pass, the last round and the base logits is the data label, and C of the tf pass, of the rounds (their
    mean; 0 without rounds) and of the base logits.  # [R, 8]"""


def _term(
    z: Tensor, p: Tensor, target: Tensor, ce_weight: float, tv_weight: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """C = ce CE(z, target) + tv TV(softmax z, p) of each row, its TV, its argmax and d C / dz; `z` is consumed (it
    ends as softmax z).  # [R], [R], [R], [R, V]"""
    pred = z.argmax(-1)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # [R, 1]
    ce = (lse - z.gather(1, target[:, None]))[:, 0]
    q = z.sub_(lse).exp_()  # [R, V] softmax z, in place
    grad = q - p  # [R, V]
    tv = 0.5 * grad.abs().sum(-1)
    grad.sign_()
    # d TV / dz = q (s - <s, q>) / 2 with s = sign(q - p); then the CE's q - onehot
    grad.sub_((grad[:, None, :] @ q[:, :, None])[:, 0]).mul_(q).mul_(0.5 * tv_weight)
    grad.add_(q, alpha=ce_weight).scatter_add_(1, target[:, None], torch.full_like(lse, -ce_weight))
    return ce_weight * ce + tv_weight * tv, tv, pred, grad


def chunk_loss(
    xhead: XPressHead, settings: XPressSettings, logits: Tensor, teacher: Tensor, hcache: Tensor, tokens: Tensor,
    prev0: Tensor, weights: Tensor, labels: Tensor, d_logits: Tensor, grads: LatentGrads,
) -> ChunkTerms:
    """Section 14's loss over one chunk of n whole blocks while their logits exist: R = n (B-1) rows, slots 1..B-1.

    `logits [R, V]` are the base logits head(h) (fp32; not changed), `teacher [R, V]` the target's probabilities P
    (not changed), `hcache [n, B, 2r]` the blocks' hidden cache (detached), `tokens [n, B]` their true tokens
    t_p..t_{p+B-1}, `prev0 [n]` training's prev_0, `weights [R]` each row's slot weight times its supervision, and
    `labels [R]` the data tokens (metrics only). Adds d total / d logits, NOT multiplied by the rows' weights (the
    caller's head matmul applies them, as the head loop does), into `d_logits [R, V]`, and the gradients of the
    refiner's weights (`chunk_params`) into `grads`. Holds at most five `[R, V]` tensors: the base logits, P and
    d_logits throughout, and each pass's refined logits (made softmax in place) and their gradient, freed after it.
    """
    s, dt = settings, logits.dtype
    n, b = tokens.shape
    weights_t = tuple(p.to(dt) for p in chunk_params(xhead))
    w2 = weights_t[-1]
    target = teacher.argmax(-1)  # [R] the CE's label: the target's argmax
    rounds = s.consistency_rounds

    def refined(prev: Tensor, coef: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """C, TV, argmax and d_hcache of one refiner pass with prev `[n, B]`, its gradient (times `coef`) added in."""
        latent = _Latent(weights_t, prev, hcache)
        x = latent.x[:, 1:].reshape(-1, latent.x.shape[-1])  # [R, r] slot 0 is never read out
        c, tv, pred, grad = _term(torch.addmm(logits, x, w2.T), teacher, target, s.ce_weight, s.tv_weight)
        d_logits.add_(grad, alpha=coef)
        scale = (coef * weights)[:, None]  # [R, 1] the rows' weights, applied on the rank side
        grads.w2.add_(grad.T @ (x * scale))
        dx = torch.zeros_like(latent.x)
        dx[:, 1:] = ((grad @ w2) * scale).view(n, b - 1, -1)
        del grad
        return c, tv, pred, latent.backward(dx, grads)

    c_base, tv_base, pred_base, grad = _term(logits.clone(), teacher, target, s.ce_weight, s.tv_weight)
    d_logits.add_(grad, alpha=s.base_weight)
    del grad
    c_tf, tv_tf, pred_tf, d_hcache = refined(teacher_forced_prev(tokens, prev0), 1.0)
    c_rounds = torch.zeros_like(c_tf)  # [R] mean of the rounds' C
    pred, anchor = pred_base, tokens[:, 0]
    for _ in range(rounds):  # each round reads the previous pass's argmax, detached (slot 0: the anchor)
        c, _, pred, d = refined(drafted_prev(anchor, pred.view(n, b - 1), prev0), s.consistency_weight / rounds)
        c_rounds = c_rounds + c / rounds
        d_hcache = d_hcache + d
    total = (weights * (c_tf + s.consistency_weight * c_rounds + s.base_weight * c_base)).sum()
    right = [(p == labels).to(dt) for p in (pred_tf, pred, pred_base)]  # pred: the last round's, else the base's
    rows = torch.stack([1 - tv_tf, 1 - tv_base, *right, c_tf, c_rounds, c_base], -1)
    return ChunkTerms(total, d_hcache, rows)


ROW_NAMES = ("accept", "base_accept", "right", "rounds_right", "base_right", "loss_tf", "loss_rounds", "loss_base")
"""What each of `ChunkTerms.rows`' columns holds (1 - TV tf, 1 - TV base, argmax hits: tf, last round, base; C of
tf, rounds, base)."""


class XPressMetrics(Metric):
    """Per slot 1 - TV of the teacher-forced refined logits and of the base logits, the tau each implies (1 + sum_k
    prod_{i<=k} (1 - TV_i)), and the accepted prefixes of the argmax hits: teacher-forced refined (left-to-right
    greedy along a correct prefix), the last consistency round (R Jacobi passes from the base argmax) and the base."""

    full_state_update = False

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_size = block_size
        for name in ("slots", "accept", "base_accept"):
            self.add_state(name, torch.zeros(block_size - 1), dist_reduce_fx="sum")  # [B-1]
        for name in ("right", "rounds_right", "base_right", "blocks"):
            self.add_state(name, torch.zeros(()), dist_reduce_fx="sum")

    def update(self, rows: Tensor, labels: Tensor, supervised: Tensor) -> None:
        """`rows [A, B-1, 8]` (`ROW_NAMES`), `supervised [A, B]` (slot 0 never)."""
        m = supervised[:, 1:].float()
        rows = rows.float()
        self.slots += m.sum(0)
        self.accept += (rows[..., 0] * m).sum(0)
        self.base_accept += (rows[..., 1] * m).sum(0)
        valid = m[:, 0]  # blocks whose first draft counts
        for i, name in ((2, "right"), (3, "rounds_right"), (4, "base_right")):
            setattr(self, name, getattr(self, name) + ((rows[..., i] * m).cumprod(-1).sum(-1) * valid).sum())
        self.blocks += valid.sum()

    def compute(self) -> dict[str, Tensor]:
        slots, blocks = self.slots.clamp_min(1), self.blocks.clamp_min(1)
        accept, base = self.accept / slots, self.base_accept / slots  # [B-1]
        out = {"xpress/accept": accept.mean(), "xpress/base_accept": base.mean(),
               "xpress/tau_tv": 1 + accept.cumprod(0).sum(), "xpress/base_tau_tv": 1 + base.cumprod(0).sum(),
               "xpress/tau_greedy": 1 + self.right / blocks, "xpress/tau_rounds": 1 + self.rounds_right / blocks,
               "xpress/base_tau_greedy": 1 + self.base_right / blocks}
        for k in range(self.block_size - 1):
            out[f"xpress/accept/slot_{k + 1:02d}"] = accept[k]
        return out


# ---- the folder vLLM 0.34 serves, and speculators' own ------------------------------------------------------------
FOLDER_FIELDS = {"xpress_rank": "rank", "xpress_mlp_hidden": "mlp_hidden", "xpress_num_passes": "num_passes",
                 "xpress_topc": "topc"}
"""config.json's top-level XPress fields (vLLM reads them only there) -> settings field."""


def folder_fields(settings: XPressSettings, block_size: int) -> dict[str, Any]:
    """The top-level config.json fields of a Qwen3XPressModel folder (section 14), beside section 7's: all written,
    `xpress_topc` too (vLLM scores the top 512 where it is missing, which is not what trained), and the fill-in
    layout (`XPressSpeculator` refuses `sample_from_anchor: true`)."""
    out = {key: getattr(settings, name) for key, name in FOLDER_FIELDS.items()}
    return {**out, "xpress_block_size": block_size, "sample_from_anchor": False}


def settings_from_folder(raw: dict[str, Any], block_size: int, source: str) -> XPressSettings:
    """The settings of a Qwen3XPressModel folder's config.json `raw` (its top level, as vLLM reads it), a missing
    field at vLLM's default (`VLLM_DEFAULTS`); training-only fields at their defaults. A value vLLM would serve
    differently from what this package trains is refused naming the field."""
    values = {}
    for key, name in FOLDER_FIELDS.items():
        value = raw.get(key, VLLM_DEFAULTS[key])
        if type(value) is not int or value < (0 if name == "topc" else 1):
            raise ConfigError(f"{source}: {key} must be an integer >= {0 if name == 'topc' else 1}, got {value!r}")
        values[name] = value
    trained = raw.get("xpress_block_size", block_size)
    if trained != block_size:  # vLLM sizes the mixer by it and the block by num_speculative_tokens + 1
        raise ConfigError(f"{source}: xpress_block_size {trained!r} is not block_size {block_size}")
    if raw.get("sample_from_anchor", False) is not False:
        raise ConfigError(f"{source}: sample_from_anchor {raw['sample_from_anchor']!r}: XPress trains and serves the "
                          "fill-in block (docs/method.md 3 and 14); vLLM refuses an anchor-first XPress folder")
    if raw.get("draft_vocab_size") not in (None, raw.get("vocab_size")):
        raise ConfigError(f"{source}: draft_vocab_size {raw['draft_vocab_size']} is not vocab_size "
                          f"{raw.get('vocab_size')}: XPress drafts over the full vocabulary (vLLM refuses others)")
    return XPressSettings(**values)


def weight_shapes(settings: XPressSettings, vocab_size: int, hidden_size: int, block_size: int
                  ) -> dict[str, tuple[int, ...]]:
    """Every weight of the refiner by its name, in the drafter's state dict and in the folder alike (the names are
    the folder's: vLLM's `Qwen3XPressForCausalLM.load_weights` maps them to its own), and its shape."""
    r, m = settings.rank, settings.mlp_hidden
    shapes = {"w1.weight": (vocab_size, r), "down_h.weight": (r, hidden_size), "down_g.weight": (r, hidden_size),
              "in_proj.weight": (r, 3 * r), "mix.L": (r, block_size, block_size), "mlp.gate_proj.weight": (m, r),
              "mlp.up_proj.weight": (m, r), "mlp.down_proj.weight": (r, m), "w2.weight": (vocab_size, r)}
    return {PREFIX + name: shape for name, shape in shapes.items()}


SPECULATORS_TYPE = "xpress"
"""`speculators_model_type` of speculators 0.9's own XPress folder."""
SPECULATORS_NAMES = {
    "token_embed.weight": "w1.weight", "down_h.weight": "down_h.weight", "down_g.weight": "down_g.weight",
    "in_proj.weight": "in_proj.weight", "mix_l": "mix.L", "mlp_gate.weight": "mlp.gate_proj.weight",
    "mlp_up.weight": "mlp.up_proj.weight", "mlp_down.weight": "mlp.down_proj.weight", "readout.weight": "w2.weight",
}
"""speculators 0.9's refiner weight (under `refiner_head.`) -> ours (under `xpress_head.`); the raw mixer is the same
tensor (`mix_l` [r, B, B], masked and added to the identity as ours)."""
SPECULATORS_QWEN3_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "vocab_size", "attention_bias", "hidden_act", "rope_theta", "rope_scaling",
    "rope_parameters", "layer_types", "sliding_window", "use_sliding_window",
)
"""transformer_layer_config fields a Qwen3XPressModel folder carries at its top level (section 7)."""


def from_speculators(raw: dict[str, Any], state: dict[str, Tensor], num_target_layers: int, source: str
                     ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """speculators 0.9's own `xpress` folder (config.json `raw`, weights `state`) as the Qwen3XPressModel folder vLLM
    0.34 serves: its config.json (section 7's fields, `dflash_config`, section 14's) and its weights renamed.

    speculators stores the Qwen3 fields as a diff against transformers' Qwen3Config defaults (filled here as it
    fills them), the target layers as hidden-state indices (`aux_hidden_state_layer_ids`, the layer id + 1, as
    vLLM's speculators adapter reads them) and no target layer count (`num_target_layers`, given). A
    reduced-vocabulary or anchor-first XPress, which vLLM cannot serve, is refused naming the field.
    """
    from transformers import Qwen3Config

    if raw.get("speculators_model_type") != SPECULATORS_TYPE:
        raise ConfigError(f"{source}: speculators_model_type {raw.get('speculators_model_type')!r} is not "
                          f"{SPECULATORS_TYPE!r}")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{source}: transformer_layer_config is missing")
    qwen3 = Qwen3Config(**layer).to_dict()
    if raw.get("sample_from_anchor", False) is not False:
        raise ConfigError(f"{source}: sample_from_anchor true: vLLM serves XPress only in the fill-in layout")
    if raw.get("draft_vocab_size", qwen3["vocab_size"]) != qwen3["vocab_size"] or "d2t" in state or "t2d" in state:
        raise ConfigError(f"{source}: draft_vocab_size {raw.get('draft_vocab_size')} is not the vocabulary "
                          f"({qwen3['vocab_size']}): XPress drafts over the full vocabulary")
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size", "xpress_rank"):
        if raw.get(key) is None:
            raise ConfigError(f"{source}: {key} is missing")
    block = raw["block_size"]
    rank = raw["xpress_rank"]
    config = {"architectures": [VLLM_ARCHITECTURE], "model_type": "qwen3",
              **{k: qwen3[k] for k in SPECULATORS_QWEN3_FIELDS if qwen3.get(k) is not None},
              "num_hidden_layers": qwen3["num_hidden_layers"], "tie_word_embeddings": False,
              "num_target_layers": num_target_layers, "block_size": block}
    if raw.get("sliding_window_non_causal") and "sliding_attention" in (qwen3.get("layer_types") or []):
        config["is_causal"] = False  # section 3b: sliding layers bidirectional inside the block
    settings = XPressSettings(rank=rank, mlp_hidden=rank * raw.get("xpress_mlp_ratio", 2),
                              num_passes=raw.get("num_jacobi_passes", VLLM_DEFAULTS["xpress_num_passes"]))
    config |= folder_fields(settings, block)
    config["dflash_config"] = {"mask_token_id": raw["mask_token_id"],
                               "target_layer_ids": [i - 1 for i in raw["aux_hidden_state_layer_ids"]]}
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    weights = {}
    for key, value in state.items():
        if key.startswith("refiner_head."):
            name = key.removeprefix("refiner_head.")
            if name not in SPECULATORS_NAMES:
                raise ConfigError(f"{source}: unknown refiner weight {key!r} (speculators 0.9 has "
                                  f"{', '.join('refiner_head.' + k for k in SPECULATORS_NAMES)})")
            key = PREFIX + SPECULATORS_NAMES[name]
        weights[key] = value
    return config, weights


# ---- the part: what the drafter, the module, the decoder, export and import call (parts/base.py) ------------------
class XPress(Part):
    """XPress's refiner (`xpress_head.*`, the folder's names) on section 3's block: section 14's loss, its metrics,
    Jacobi drafting, and the top-level config.json fields of the Qwen3XPressModel folder vLLM 0.34 serves."""

    name = "xpress"
    settings_type = XPressSettings
    config_fields: ClassVar[dict[str, str]] = FOLDER_FIELDS
    """Written at config.json's top level, where vLLM reads them (`top_level_fields`), not in dflash_config."""
    folder_defaults: ClassVar[dict[str, Any]] = VLLM_DEFAULTS
    weight_prefix = PREFIX.rstrip(".")
    layout = FILL_IN_GAMMA_4
    fp8_exempt = True  # a small refiner (rank r) whose weights the loss reads by hand
    needs_final_hidden = True  # P_k = softmax(head(h_final[p + k - 1])): every term distils (section 4c)
    # Section 14's loss is its own (CE and TV to the target's distribution, exp(-(k-1)/gamma) slot weights): no
    # distillation objective beside it, no D-PACE weights.
    own_loss = "XPress (model.drafter.xpress) trains with section 14's loss"
    decodes = True
    opd_refusal = ("drafts from Jacobi passes of a refiner that reads the previous pass's drafts: the stage would "
                   "have to train the last pass on the draft's own tokens, which is not built")
    head_rows = 1

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.head = XPressHead(config.vocab_size, config.hidden_size, config.block_size, self.settings)
        self.block_size, self.gamma = config.block_size, config.loss_gamma

    def attach(self, drafter: nn.Module) -> None:
        drafter.add_module(self.weight_prefix, self.head)

    def reset_parameters(self) -> None:
        self.head.reset_parameters()

    # --- training: inside the chunked head loop, with hand-made gradients (loss.py, docs/parts.md)
    def head_params(self) -> tuple[Tensor, ...]:
        return chunk_params(self.head)

    def head_inputs(self, batch: TrainInputs) -> tuple[Tensor, ...]:
        """Per block: the hidden cache [down_h h_k; down_g g] (made here by autograd, so its gradient reaches
        down_h, down_g and every slot's h, slot 0's included), the true tokens t_p..t_{p+B-1} and prev_0; per row:
        the target's final hidden state that predicts the row's label (the teacher P of every term)."""
        labels = batch.labels  # [A, B] t_p..t_{p+B-1}: fill-in labels, slot 0 the anchor's token
        if self.settings.prev0 == "anchor":
            prev0 = labels[:, 0]
        else:
            prev0 = token_before_anchor(batch.input_ids, batch.doc_ids, batch.anchors)  # [A]
        hcache = self.head.hidden_cache(batch.hidden)  # [A, B, 2r]
        teacher = batch.final_hidden[batch.before[:, 1:]].flatten(0, 1)  # [N, H]
        return hcache, labels, prev0, teacher

    def objective_weight(self) -> float:
        """The head loop's own CE is not among section 14's terms (its base term is C of head(h), `base_weight`): at
        0 the loop computes none."""
        return 0.0

    def head_chunk(self, chunk: HeadChunk) -> ChunkResult:
        """Section 14's terms of one chunk of whole blocks (`chunk_loss`) on the loop's base logits, with the
        target's P made here; the hidden cache's gradient goes back through `grad_inputs`."""
        hcache, tokens, prev0, teacher = chunk.rows
        with torch.autocast(chunk.d_logits.device.type, enabled=False):  # fp32 sums, fp32 index_add_
            dt = chunk.logits.dtype  # fp32 (fp64 in the tests)
            p = torch.softmax(F.linear(teacher.to(chunk.head.dtype), chunk.head).to(dt), -1)  # [R, V]
            out = chunk_loss(self.head, self.settings, chunk.logits, p, hcache.to(dt), tokens, prev0, chunk.weights,
                             chunk.labels, chunk.d_logits, LatentGrads(*chunk.grads))
        return ChunkResult(loss=out.total, grad_inputs=(out.d_hcache,), rows=(out.rows,))

    def loss_denominator(self, batch: TrainInputs) -> Tensor:
        """Section 14 divides each term by the count of supervised slots (speculators' sum m), not by the slot
        weights' sum."""
        return batch.supervised[:, 1:].float()

    def loss(self, batch: TrainInputs, head: HeadOutput | None, settings: Any) -> PartOutput:
        """Each term's mean over the supervised slots (this rank's), and the rows `XPressMetrics` counts."""
        rows = head.rows[0].unflatten(0, (batch.labels.shape[0], -1))  # [A, B-1, 8]
        w = slot_weights(self.block_size, self.gamma, rows.device, self.layout)[1:] * batch.supervised[:, 1:]
        n = batch.supervised[:, 1:].sum().clamp_min(1)
        sums = (w[..., None] * rows[..., 5:]).sum((0, 1)) / n  # [3] tf, rounds, base
        logs = {"xpress/loss_tf": sums[0], "xpress/loss_base": sums[2]}
        if self.settings.consistency_rounds:
            logs["xpress/loss_rounds"] = sums[1]
        return PartOutput(logs=logs, rows=rows)

    @classmethod
    def metric(cls, block_size: int) -> Metric:
        return XPressMetrics(block_size)

    # --- decoding
    @torch.no_grad()
    def draft(self, inputs: DraftInputs) -> Draft:
        """The block resolved by `num_passes` Jacobi passes from the whole block's hidden states, the anchor as prev_0
        (vLLM 0.34's rule); at T > 0 the greedy block as point masses, or with `sampled_drafts` the xPress harness's
        Gumbel drafts and their q."""
        if inputs.block_hidden is None:
            raise ValueError("XPress drafts from every slot's hidden state: DraftInputs.block_hidden is None")
        s = self.settings
        out = jacobi_draft(self.head, inputs.block_hidden[None], inputs.logits[None], inputs.first_prev.reshape(1),
                           s.num_passes, s.topc, inputs.temperature, s.sampled_drafts, inputs.generator)
        return Draft(out.tokens[0], None if out.q is None else out.q[0])

    # --- export and import: config.json's top level (section 14)
    @classmethod
    def export_fields(cls, settings: XPressSettings, config: Any = None) -> dict[str, Any]:
        return {}

    @classmethod
    def top_level_fields(cls, settings: XPressSettings, config: Any = None) -> dict[str, Any]:
        return folder_fields(settings, config.block_size)

    @classmethod
    def speculative_config(cls, settings: XPressSettings) -> dict[str, Any]:
        """vLLM scores each slot's top 512 base candidates unless told; 0 is the full vocabulary, training's."""
        return {"xpress_topc": settings.topc}

    @classmethod
    def read_fields(cls, dflash: dict[str, Any], source: str) -> XPressSettings:
        return settings_from_folder(dflash, dflash["block_size"], source)

    @classmethod
    def convert_folder(cls, raw: dict[str, Any], state: dict[str, Tensor], source: str,
                       num_target_layers: int | None) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
        """speculators 0.9's own `xpress` folder, as the Qwen3XPressModel folder (`from_speculators`); it does not
        record the target's layer count, so the target must be known."""
        if raw.get("speculators_model_type") != SPECULATORS_TYPE:
            return None
        if num_target_layers is None:
            verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
            named = f" (its speculators_config names {verifier})" if verifier else ""
            raise ConfigError(f"{source}: a speculators XPress folder does not record its target's layer count; give "
                              f"the target it was trained for{named}")
        return from_speculators(raw, state, num_target_layers, source)


__all__ = [
    "FILL_IN_GAMMA_4", "FOLDER_FIELDS", "PREFIX", "ROW_NAMES", "SPECULATORS_NAMES", "SPECULATORS_TYPE",
    "VLLM_ARCHITECTURE", "VLLM_DEFAULTS", "CausalMix", "ChunkTerms", "JacobiDraft", "LatentGrads", "SwiGLU", "XPress",
    "XPressHead", "XPressMetrics", "XPressSettings", "chunk_loss", "chunk_params", "drafted_prev", "folder_fields",
    "from_speculators", "gumbel", "jacobi_draft", "mix_blocks", "mix_grad", "settings_from_folder",
    "teacher_forced_prev", "token_before_anchor", "weight_shapes",
]
