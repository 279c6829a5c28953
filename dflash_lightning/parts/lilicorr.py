"""LiLiCorr (docs/method.md section 11): a small transformer over each block's candidate lattice, its scores, walks,
losses, metrics and export fields. Slot t (1..B-1) keeps the unary top K; the walk picks one candidate per slot.

Shapes: A anchors (blocks), S = B - 1 slots (fewer when decoding a shorter block), K candidates, H the drafter's
width, Hh the lattice width, F the factor width, V the vocabulary. Candidate lists are best first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric

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
from dflash_lightning.parts.topk import unary_top_k

PREFIX = "lilicorr."  # every weight of the part sits under it in the drafter and in the folder
NUM_FEATURES = 5  # [l, exp(l), l - l_1, rank fraction, is top 1], in the feature MLP's input order
MARGIN = 2.0  # the hinge of L_margin: the label's score should lead the best other candidate by this much


@dataclass
class LiLiCorrSettings:
    """The lattice reranker's geometry (`dflash_config.lilicorr_<field>`, all eight read by the engines) and its loss
    weights (`model.drafter.lilicorr.*`)."""

    candidate_topk: int = 8
    """K: candidates per slot, the unary top K (the engines take a power of two <= 16)."""
    hidden_size: int = 1024
    """Hh: width of the lattice transformer; 0 means the drafter's width H (then no token_proj)."""
    factor_dim: int = 1024
    """F: width of the out/in factor vectors whose cosines score the walk's steps."""
    num_layers: int = 2
    """Layers of the lattice transformer."""
    num_heads: int = 8
    """Attention heads of the lattice transformer (Hh must be divisible by it)."""
    mlp_ratio: float = 2.0
    """Lattice MLP width as a multiple of Hh."""
    logit_scale: float = 8.0
    """s: constant scale of the cosine scores (changes scores, no shape)."""
    vector_eps: float = 1e-4
    """eps of the factor vectors' L2 normalisation (changes scores, no shape)."""
    ce_weight: float = 0.25
    """Weight of L_ce, the walk's K-way cross-entropy at the label, in the total loss (a training choice)."""
    margin_weight: float = 0.0
    """Weight of L_margin, relu(2 + best other score - label score) (the 'margin' recipe: 0.125, with ce 0.125)."""
    penalty_weight: float = 0.25
    """Weight of L_pen, the walk's probability on candidates the target ranks below the label, times the gap."""
    token_proj_std: float | None = None
    """Init std of token_proj's weight (a training choice, not exported); None: 0.02 as every Linear. Only with a
    token_proj (Hh != H): the candidate's frozen embedding row enters at this gain (docs/lilicorr.md)."""

    def check(self, config: Any) -> None:
        """Raise ConfigError naming the field of a value that cannot work for the drafter `config`."""
        k = self.candidate_topk
        if not 1 <= k <= 16 or k & (k - 1):
            raise ConfigError(f"lilicorr.candidate_topk must be a power of two in 1..16 (the engines'), got {k}")
        if getattr(config, "vocab_size", None) and k > config.vocab_size:
            raise ConfigError(f"lilicorr.candidate_topk ({k}) exceeds vocab_size ({config.vocab_size})")
        for name in ("factor_dim", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"lilicorr.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size < 0:
            raise ConfigError(f"lilicorr.hidden_size must be >= 0 (0: the drafter's width), got {self.hidden_size}")
        width = self.width(getattr(config, "hidden_size", None) or self.hidden_size)
        if width and width % self.num_heads:
            raise ConfigError(f"lilicorr.hidden_size ({width}{' = the drafter width' if not self.hidden_size else ''})"
                              f" must be divisible by num_heads ({self.num_heads})")
        for name in ("mlp_ratio", "logit_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"lilicorr.{name} must be > 0, got {getattr(self, name)}")
        if width and int(width * self.mlp_ratio) < 1:  # the MLP's width is int(Hh * mlp_ratio)
            raise ConfigError(f"lilicorr.mlp_ratio must be >= 1/Hh = {1 / width:.4g} (Hh {width}: a lattice MLP of at "
                              f"least one unit), got {self.mlp_ratio}")
        if not 0 < self.vector_eps < 0.5:
            raise ConfigError(f"lilicorr.vector_eps must be in (0, 0.5), got {self.vector_eps}")
        for name in ("ce_weight", "margin_weight", "penalty_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"lilicorr.{name} must be >= 0, got {getattr(self, name)}")
        std = self.token_proj_std
        if std is not None:
            if not 0 < std < float("inf"):
                raise ConfigError(f"lilicorr.token_proj_std must be > 0 and finite (None: 0.02), got {std}")
            drafter = getattr(config, "hidden_size", None)
            if not self.hidden_size or self.hidden_size == drafter:
                width = f"{drafter}, " if drafter else ""
                raise ConfigError(f"lilicorr.token_proj_std ({std}) is set but the lattice has no token_proj "
                                  f"(hidden_size {self.hidden_size}: the drafter's width {width}so Hh = H); set "
                                  "hidden_size to another width, or leave token_proj_std unset")
        if not (self.ce_weight or self.margin_weight or self.penalty_weight):
            raise ConfigError("lilicorr: ce_weight, margin_weight and penalty_weight are all 0, so the reranker "
                              "would never train; set one above 0")

    def width(self, hidden_size: int) -> int:
        """Hh for a drafter of width H."""
        return self.hidden_size or hidden_size


GEOMETRY = ("candidate_topk", "hidden_size", "factor_dim", "num_layers", "num_heads", "mlp_ratio", "logit_scale",
            "vector_eps")  # the settings exported as dflash_config.lilicorr_<name>, in that order
FLOAT_GEOMETRY = ("mlp_ratio", "logit_scale", "vector_eps")


def weight_shapes(settings: LiLiCorrSettings, hidden_size: int, block_size: int) -> dict[str, tuple[int, ...]]:
    """Every weight of the part by its folder name (under `lilicorr.`) and shape."""
    hh, f, k, n_h = settings.width(hidden_size), settings.factor_dim, settings.candidate_topk, settings.num_heads
    mlp = int(hh * settings.mlp_ratio)
    linears = {"pass_hidden_proj": (hh, hidden_size), "context_proj": (hh, hidden_size),
               "factor_input_proj": (hh, 3 * hh), "out_head": (f, hh), "in_head": (f, hh), "anchor_out_head": (f, hh),
               "feature_norm": (NUM_FEATURES,), "feature_mlp.up_proj": (hh, NUM_FEATURES),
               "feature_mlp.down_proj": (hh, hh)}
    if hh != hidden_size:
        linears["token_proj"] = (hh, hidden_size)
    for j in range(settings.num_layers):
        linears |= {f"layers.{j}.attn.out_proj": (hh, hh), f"layers.{j}.mlp.up_proj": (mlp, hh),
                    f"layers.{j}.mlp.down_proj": (hh, mlp)}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in linears.items():
        shapes[f"{name}.weight"] = shape
        shapes[f"{name}.bias"] = shape[:1]
    shapes |= {"slot_embedding": (1, 1, block_size - 1, 1, hh), "rank_embedding": (1, 1, 1, k, hh),
               "relative_slot_bias": (n_h, 2 * block_size - 1), "same_slot_bias": (n_h,),
               "output_norm.weight": (hh,), "anchor_norm.weight": (hh,)}
    for j in range(settings.num_layers):
        shapes |= {f"layers.{j}.attn_norm.weight": (hh,), f"layers.{j}.mlp_norm.weight": (hh,),
                   f"layers.{j}.attn.in_proj_weight": (3 * hh, hh), f"layers.{j}.attn.in_proj_bias": (3 * hh,)}
    return {PREFIX + name: shape for name, shape in shapes.items()}


# ---- candidates -------------------------------------------------------------------------------------------------


class _CandidateLogProbs(torch.autograd.Function):
    """l = logit(c) - logsumexp(logits) per candidate, with its gradient to the hidden state from two saved rows."""

    @staticmethod
    def forward(ctx, hidden: Tensor, candidate_logits: Tensor, lse: Tensor, candidate_rows: Tensor,
                expected_row: Tensor) -> Tensor:
        ctx.save_for_backward(candidate_rows, expected_row)
        ctx.hidden_dtype = hidden.dtype
        return _f32(candidate_logits) - _f32(lse)[..., None]

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, expected = ctx.saved_tensors
        # d l_j / d h = head[c_j] - sum_v softmax_v head[v]: the second term is the expected row, saved by the caller
        g = torch.einsum("...k,...kh->...h", grad, rows.to(grad.dtype)) - grad.sum(-1, keepdim=True) * expected.to(
            grad.dtype)
        return g.to(ctx.hidden_dtype), None, None, None, None


def _f32(x: Tensor) -> Tensor:
    """x in fp32 at least (fp64 stays fp64, as the tests' references run)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def candidate_log_probs(hidden: Tensor, candidate_logits: Tensor, lse: Tensor, head: Tensor | None = None,
                        candidates: Tensor | None = None, expected_row: Tensor | None = None) -> Tensor:
    """Full-vocabulary log_softmax at the candidates, l `[.., K]` fp32, from what a chunked head loop keeps per row:
    the candidates' logits `[.., K]` and the row's logsumexp `[..]`.

    With `head [V, H]`, `candidates [.., K]` and `expected_row [.., H]` (softmax(logits) @ head, made in the same
    loop) l carries its exact gradient to `hidden [.., H]` without any `[rows, V]` tensor being kept; without them
    l is a plain (detached) value, as decoding needs.
    """
    if expected_row is None:
        return _f32(candidate_logits.detach()) - _f32(lse.detach())[..., None]
    rows = head.detach()[candidates]  # [.., K, H]
    return _CandidateLogProbs.apply(hidden, candidate_logits.detach(), lse.detach(), rows, expected_row.detach())


def candidate_features(log_probs: Tensor) -> Tensor:
    """f of each candidate from l `[.., K]` (best first): [l, exp(l), l - l_1, (j-1)/(K-1), 1{j = 1}].  # [.., K, 5]"""
    l = _f32(log_probs)  # noqa: E741
    k = l.shape[-1]
    rank = torch.arange(k, device=l.device, dtype=l.dtype) / max(k - 1, 1)  # 0 for K = 1
    top1 = (torch.arange(k, device=l.device) == 0).to(l.dtype)
    return torch.stack([l, l.exp(), l - l[..., :1], rank.expand_as(l), top1.expand_as(l)], -1)


@torch.no_grad()
def target_candidate_logits(final_hidden: Tensor, head: Tensor, candidates: Tensor, chunk: int = 64) -> Tensor:
    """The target's raw logits z at the candidates, fp32 and detached: `final_hidden [A, S, H]` (h_final of the
    position before each slot's token) times the K gathered head rows, in chunks of anchors.  # [A, S, K]"""
    out = torch.empty(candidates.shape, dtype=torch.promote_types(head.dtype, torch.float32), device=head.device)
    for start in range(0, candidates.shape[0], chunk):
        end = start + chunk
        rows = head[candidates[start:end]]  # [chunk, S, K, H]
        out[start:end] = torch.einsum("ash,askh->ask", final_hidden[start:end].to(rows.dtype), rows)
    return out


# ---- the reranker -----------------------------------------------------------------------------------------------


class LatticeMLP(nn.Module):
    """up_proj, SiLU, down_proj, all with biases."""

    def __init__(self, d_in: int, d_mid: int, d_out: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_in, d_mid)
        self.down_proj = nn.Linear(d_mid, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """Unmasked multi-head attention over the lattice with an additive per-head bias; packed q, k, v projection."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))  # [q; k; v]
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """x `[A, L, Hh]`, bias `[n_h, L, L]` (query, key).  # [A, L, Hh]"""
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).unflatten(-1, (3, self.num_heads, -1)).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [A, n_h, L, Hh / n_h]; SDPA's scale is (Hh / n_h)^-1/2
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype)[None])
        return self.out_proj(out.transpose(1, 2).flatten(2))


class LatticeLayer(nn.Module):
    """Pre-norm attention and MLP sublayers with residuals."""

    def __init__(self, width: int, num_heads: int, mlp_width: int, eps: float) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=eps)
        self.attn = LatticeAttention(width, num_heads)
        self.mlp_norm = nn.RMSNorm(width, eps=eps)
        self.mlp = LatticeMLP(width, mlp_width, width)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.attn(_rms(self.attn_norm, x), bias)
        return x + self.mlp(_rms(self.mlp_norm, x))


def _rms(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """RMSNorm computed in fp32, returned in x's dtype (as the drafter's own norms)."""
    return F.rms_norm(_f32(x), norm.normalized_shape, _f32(norm.weight), norm.eps).to(x.dtype)


def attention_bias(relative_slot_bias: Tensor, same_slot_bias: Tensor, slots: int, topk: int,
                   block_size: int) -> Tensor:
    """The lattice attention's head bias: `relative_slot_bias[h, t_q - t_k + B - 1] + same_slot_bias[h] 1{t_q = t_k}`
    over the flattened (slot, candidate) order, slot-major.  # [n_h, S*K, S*K]"""
    slot = torch.arange(slots, device=relative_slot_bias.device).repeat_interleave(topk)  # [S*K]
    distance = slot[:, None] - slot[None, :]
    same = (distance == 0).to(relative_slot_bias.dtype)
    return relative_slot_bias[:, distance + block_size - 1] + same_slot_bias[:, None, None] * same


class LiLiCorrReranker(Part):
    """The part (`drafter.lilicorr`): lattice states, the lattice transformer and the start/pair scores; its training
    term after the head loop, its metrics, its greedy and sampled walks and its export fields."""

    name = "lilicorr"
    settings_type = LiLiCorrSettings
    config_fields: ClassVar[dict[str, str]] = {f"lilicorr_{n}": n for n in GEOMETRY}
    weight_prefix = "lilicorr"
    needs_final_hidden = True  # L_pen reads the target's logits at the candidates
    decodes = True
    opd_refusal = ("drafts by a walk over each slot's top-K lattice without the unary prior: its draft "
                   "distribution is 0 outside the K candidates, where the forward KL to the target is infinite")
    head_rows = 4  # candidate ids, their logits, the row's logsumexp, softmax(logits) @ head
    fp8_exempt = True  # the lattice (13% of the drafter's FLOPs) stays bf16 under model.fp8=all: FP8 unmeasured

    def __init__(self, config: Any) -> None:
        """`config`: the resolved drafter config (hidden_size, block_size, rms_norm_eps and the `lilicorr` settings)."""
        super().__init__(config)
        settings, self.block_size = self.settings, config.block_size
        h, block_size = config.hidden_size, config.block_size
        hh, f, k = settings.width(h), settings.factor_dim, settings.candidate_topk
        if hh % settings.num_heads:
            raise ConfigError(f"lilicorr: width {hh} (hidden_size 0 = the drafter's) must be divisible by num_heads "
                              f"({settings.num_heads})")
        self.top_k, self.width = k, hh
        self.token_proj = nn.Linear(h, hh) if hh != h else None
        self.pass_hidden_proj = nn.Linear(h, hh)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = LatticeMLP(NUM_FEATURES, hh, hh)
        self.slot_embedding = nn.Parameter(torch.empty(1, 1, block_size - 1, 1, hh))
        self.rank_embedding = nn.Parameter(torch.empty(1, 1, 1, k, hh))
        self.relative_slot_bias = nn.Parameter(torch.empty(settings.num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.empty(settings.num_heads))
        self.context_proj = nn.Linear(h, hh)
        self.layers = nn.ModuleList(LatticeLayer(hh, settings.num_heads, int(hh * settings.mlp_ratio),
                                                 config.rms_norm_eps) for _ in range(settings.num_layers))
        self.output_norm = nn.RMSNorm(hh, eps=config.rms_norm_eps)
        self.anchor_norm = nn.RMSNorm(hh, eps=config.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * hh, hh)
        self.out_head = nn.Linear(hh, f)
        self.in_head = nn.Linear(hh, f)
        self.anchor_out_head = nn.Linear(hh, f)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Linear weights normal(0, std) (token_proj: `token_proj_std` where set), biases 0, in_proj_weight
        xavier-uniform, tables 0, norms 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.RMSNorm, nn.LayerNorm)):
                m.reset_parameters()
            elif isinstance(m, LatticeAttention):
                nn.init.xavier_uniform_(m.in_proj_weight)
                nn.init.zeros_(m.in_proj_bias)
        for table in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
            nn.init.zeros_(table)
        if self.token_proj is not None and self.settings.token_proj_std is not None:
            nn.init.normal_(self.token_proj.weight, std=self.settings.token_proj_std)

    def states(self, token_embeddings: Tensor, log_probs: Tensor, pass_hidden: Tensor) -> Tensor:
        """x = token_proj(E[c]) + pass_hidden_proj(h_t) + slot_embedding[t] + rank_embedding[j] + feature_mlp(
        feature_norm(f)), from `E[c] [A, S, K, H]` (detached), l `[A, S, K]` and h_t `[A, S, H]`.  # [A, S, K, Hh]"""
        slots = log_probs.shape[1]
        tokens = token_embeddings.detach()
        tokens = tokens if self.token_proj is None else self.token_proj(tokens)
        features = candidate_features(log_probs).to(self.feature_norm.weight.dtype)
        x = tokens + self.pass_hidden_proj(pass_hidden)[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(features))
        return x + self.slot_embedding[0, 0, :slots] + self.rank_embedding[0, 0]

    def scores(self, token_embeddings: Tensor, log_probs: Tensor, pass_hidden: Tensor, anchor_hidden: Tensor,
               anchor_valid: Tensor) -> tuple[Tensor, Tensor]:
        """start `[A, K]` and pair `[A, S-1, K, K]` (pair[t][i, j]: candidate i of slot t+1 then j of slot t+2),
        fp32, scaled by s. `anchor_hidden [A, H]` is c_{p-1} = hidden_norm(fc(.)) of the position before the anchor;
        where `anchor_valid [A]` is false (p = 0) the anchor state is 0."""
        a_, slots, k = log_probs.shape
        x = self.states(token_embeddings, log_probs, pass_hidden).flatten(1, 2)  # [A, S*K, Hh]
        bias = attention_bias(self.relative_slot_bias, self.same_slot_bias, slots, k, self.block_size)
        for layer in self.layers:
            x = layer(x, bias)
        x = _rms(self.output_norm, x).unflatten(1, (slots, k))  # [A, S, K, Hh]
        anchor = self.context_proj(anchor_hidden) * anchor_valid[:, None].to(x.dtype)  # [A, Hh]
        anchor = _rms(self.anchor_norm, anchor)
        a = anchor[:, None, None].expand_as(x)
        g = F.silu(self.factor_input_proj(torch.cat([x, a, x * a], -1)))  # [A, S, K, Hh]
        eps = self.settings.vector_eps
        out = F.normalize(_f32(self.out_head(g)), dim=-1, eps=eps)  # [A, S, K, F]
        into = F.normalize(_f32(self.in_head(g)), dim=-1, eps=eps)
        anchor_out = F.normalize(_f32(self.anchor_out_head(anchor)), dim=-1, eps=eps)  # [A, F]
        s = self.settings.logit_scale
        start = s * torch.einsum("af,akf->ak", anchor_out, into[:, 0])
        pair = s * torch.einsum("atif,atjf->atij", out[:, :-1], into[:, 1:])
        return start, pair


    # --- training: rows from the head loop, the lattice after it
    def head_inputs(self, batch: TrainInputs) -> tuple[Tensor, ...]:
        return ()  # called in the loop, with nothing of its own per row

    def head_chunk(self, chunk: HeadChunk) -> ChunkResult:
        """What the lattice needs of rows whose full logits exist only here: the candidate ids `[R, K]`, their logits
        `[R, K]`, the logsumexp `[R]` and softmax(logits) @ head `[R, H]` (l's gradient to the hidden state)."""
        ids = chunk.top_ids[:, : self.top_k]
        probs = torch.exp(chunk.logits - chunk.lse).to(chunk.head.dtype)
        expected = F.linear(probs, chunk.head_t)  # [R, H]
        return ChunkResult(rows=(ids, chunk.logits.gather(1, ids), chunk.lse[:, 0], expected))

    def loss(self, batch: TrainInputs, head: HeadOutput | None, settings: Any) -> PartOutput:
        """The lattice terms of every block at once (fixed shapes, masks, no host sync); `PartOutput.rows` =
        (start, pair, candidate ids) for the metric."""
        if batch.final_hidden is None:
            raise ValueError("lilicorr: the distractor penalty needs the target's final hidden states "
                             "(final_hidden), and the batch has none")
        out, start, pair, ids = self.lattice_terms(batch, head.rows)
        logs = {"lilicorr/loss": out.total.detach(), "lilicorr/ce": out.ce.detach(),
                "lilicorr/margin": out.margin.detach(), "lilicorr/penalty": out.penalty.detach(),
                "lilicorr/supervised": out.supervised.float().mean()}
        return PartOutput(loss=out.total, logs=logs, rows=(start.detach(), pair.detach(), ids))

    def lattice_terms(self, batch: TrainInputs, rows: tuple[Tensor, ...]
                      ) -> tuple[LatticeLoss, Tensor, Tensor, Tensor]:
        """The losses, start and pair scores and candidate ids of every block (what `compile_hooks` compiles)."""
        a, b = batch.labels.shape
        ids, logits, lse, expected = (t.unflatten(0, (a, b - 1)) for t in rows)  # [A, S, ...]
        hidden = batch.hidden[:, 1:]  # [A, S, H]
        log_probs = candidate_log_probs(hidden, logits, lse, batch.head_weight, ids, expected)
        previous = (batch.anchors - 1).clamp_min(0)
        anchor_valid = batch.anchor_valid & (batch.position_ids[batch.anchors] > 0)  # p = 0: no c_{p-1}
        start, pair = self.scores(batch.embed_weight[ids], log_probs, hidden, batch.context[previous], anchor_valid)
        z = target_candidate_logits(batch.final_hidden[batch.before[:, 1:]], batch.head_weight, ids)
        out = lattice_loss(start, pair, ids, batch.labels[:, 1:], batch.supervised[:, 1:], z, self.settings)
        return out, start, pair, ids

    def compile_hooks(self, mode: str | None = None) -> None:
        self.lattice_terms = torch.compile(self.lattice_terms, mode=mode, dynamic=False)

    @classmethod
    def metric(cls, block_size: int) -> Metric:
        return LiLiCorrMetrics()

    # --- decoding
    @torch.no_grad()
    def draft(self, inputs: DraftInputs) -> Draft:
        """The walk over one block's lattice (no unary prior): greedy, or sampled with q = softmax(row / T) over the
        K candidates, scattered into `[B-1, V]`."""
        logits = inputs.logits
        ids = unary_top_k(logits, self.top_k)  # [S, K]
        log_probs = candidate_log_probs(inputs.hidden, logits.gather(1, ids), logits.float().logsumexp(-1))
        valid = torch.tensor([inputs.context_last is not None], device=logits.device)
        anchor = inputs.hidden.new_zeros(1, inputs.hidden.shape[-1]) if inputs.context_last is None else \
            inputs.context_last.reshape(1, -1)
        start, pair = self.scores(inputs.embed_weight[ids][None], log_probs[None], inputs.hidden[None], anchor, valid)
        if inputs.temperature == 0:
            return Draft(ids.gather(1, greedy_walk(start, pair)[0, :, None])[:, 0])
        picks, q = sampled_walk(start, pair, inputs.temperature, generator=inputs.generator)
        dist = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(1, ids, q[0].float())
        return Draft(ids.gather(1, picks[0, :, None])[:, 0], dist)

    # --- export and import
    @classmethod
    def export_fields(cls, settings: LiLiCorrSettings, config: Any = None) -> dict[str, Any]:
        """`lilicorr_enabled: true` and the eight geometry fields (floats as floats: the engines cast, ModelOpt and
        the engines' configs write them so)."""
        out: dict[str, Any] = {"lilicorr_enabled": True}
        for key, name in cls.config_fields.items():
            value = getattr(settings, name)
            out[key] = float(value) if name in FLOAT_GEOMETRY else int(value)
        return out

    @classmethod
    def read_fields(cls, dflash: dict[str, Any], source: str) -> LiLiCorrSettings:
        """The geometry from a folder (all eight required, as SGLang requires them); loss weights at their defaults."""
        if dflash.get("lilicorr_enabled") is not True:
            raise ConfigError(f"{source}: dflash_config.lilicorr_enabled must be true in a LiLiCorr folder, got "
                              f"{dflash.get('lilicorr_enabled')!r}")
        missing = [f"dflash_config.{key}" for key in cls.config_fields if key not in dflash]
        if missing:
            raise ConfigError(f"{source}: a LiLiCorr folder lacks {', '.join(missing)}")
        settings = super().read_fields(dflash, source)
        try:
            settings.check(None)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        return settings


# ---- walks ------------------------------------------------------------------------------------------------------


def _row(pair: Tensor, t: int, previous: Tensor) -> Tensor:
    """Row `previous [A]` of pair step t: the scores of slot t+2's candidates after that pick.  # [A, K]"""
    k = pair.shape[-1]
    return pair[:, t].gather(1, previous[:, None, None].expand(-1, 1, k))[:, 0]


def greedy_walk(start: Tensor, pair: Tensor) -> Tensor:
    """Greedy picks (candidate indices) slot by slot: j_1 = argmax start, j_t = argmax pair_{t-1}[j_{t-1}].  # [A, S]"""
    pick = start.argmax(-1)
    picks = [pick]
    for t in range(pair.shape[1]):
        pick = _row(pair, t, pick).argmax(-1)
        picks.append(pick)
    return torch.stack(picks, 1)


def sampled_walk(start: Tensor, pair: Tensor, temperature: float, uniforms: Tensor | None = None,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Sampled picks `[A, S]` and their draft distributions q `[A, S, K]`: q_t = softmax(row_t / T) over the K
    candidates, row_1 = start, then the sampled predecessor's pair row; drawn by inverse CDF from `uniforms [A, S]`
    (drawn here when not given)."""
    a, k = start.shape
    slots = pair.shape[1] + 1
    if uniforms is None:
        uniforms = torch.rand(a, slots, generator=generator, device=start.device)
    row, picks, qs = _f32(start), [], []
    for t in range(slots):
        if t:
            row = _f32(_row(pair, t - 1, picks[-1]))
        q = torch.softmax(row / temperature, -1)
        pick = (uniforms[:, t : t + 1] >= q.cumsum(-1)).sum(-1).clamp(max=k - 1)
        picks.append(pick)
        qs.append(q)
    return torch.stack(picks, 1), torch.stack(qs, 1)


# ---- training ---------------------------------------------------------------------------------------------------


class LatticeLoss(NamedTuple):
    """The lattice terms (plain means over the supervised slots), their weighted sum and the supervised mask."""

    total: Tensor
    ce: Tensor
    margin: Tensor
    penalty: Tensor
    supervised: Tensor  # [A, S] bool


def label_index(candidates: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Where the label is among a slot's candidates: (index g `[A, S]`, 0 where absent; in lattice `[A, S]`)."""
    hit = candidates == labels[..., None]  # [A, S, K]
    return hit.int().argmax(-1), hit.any(-1)


def supervised_slots(in_lattice: Tensor, slot_supervised: Tensor) -> Tensor:
    """Slots the lattice loss trains: label in the lattice there and at every earlier slot, in blocks whose S slots
    are all supervised (section 4's mask: in the loss mask and the document, valid anchor).  # [A, S] bool"""
    prefix = in_lattice.int().cumprod(-1).bool()
    return prefix & slot_supervised.all(-1, keepdim=True)


def teacher_rows(start: Tensor, pair: Tensor, index: Tensor) -> Tensor:
    """The walk's rows along the labels: node_1 = start, node_t = pair_{t-1}[g_{t-1}, :].  # [A, S, K]"""
    k = start.shape[-1]
    previous = index[:, :-1, None, None].expand(-1, -1, 1, k)  # [A, S-1, 1, K]
    return torch.cat([start[:, None], pair.gather(2, previous)[:, :, 0]], 1)


def lattice_loss(start: Tensor, pair: Tensor, candidates: Tensor, labels: Tensor, slot_supervised: Tensor,
                 target_logits: Tensor, settings: LiLiCorrSettings) -> LatticeLoss:
    """L_ce, L_margin and L_pen of the walk's rows along the labels (the label is NOT injected), and
    `ce_weight * L_ce + margin_weight * L_margin + penalty_weight * L_pen`.

    `candidates [A, S, K]`, `labels [A, S]` (token p + t), `slot_supervised [A, S]` (section 4's mask),
    `target_logits [A, S, K]`: the target's raw logits z_t at the candidates (`target_candidate_logits`); where a
    slot is supervised its label is a candidate, so z_t[label] is among them.
    """
    index, in_lattice = label_index(candidates, labels)
    supervised = supervised_slots(in_lattice, slot_supervised)
    node = _f32(teacher_rows(start, pair, index))  # [A, S, K]
    count = supervised.sum().to(node.dtype).clamp_min(1.0)
    g = index[..., None]
    label_score = node.gather(-1, g)[..., 0]  # [A, S]
    log_q = node.log_softmax(-1)
    ce = -log_q.gather(-1, g)[..., 0]
    others = node.masked_fill(F.one_hot(index, node.shape[-1]).bool(), float("-inf")).amax(-1)
    margin = F.relu(MARGIN + others - label_score) if node.shape[-1] > 1 else torch.zeros_like(label_score)
    z = _f32(target_logits.detach())
    gap = F.relu(z.gather(-1, g) - z)  # [A, S, K]: 0 at the label and wherever the target prefers the candidate
    penalty = (log_q.exp() * gap).sum(-1)
    ce, margin, penalty = (torch.where(supervised, term, 0.0).sum() / count for term in (ce, margin, penalty))
    total = settings.ce_weight * ce + settings.margin_weight * margin + settings.penalty_weight * penalty
    return LatticeLoss(total, ce, margin, penalty, supervised)


# ---- metrics ----------------------------------------------------------------------------------------------------


def accepted_prefix(correct: Tensor, slot_supervised: Tensor) -> Tensor:
    """Consecutive correct and supervised slots from slot 1.  # [A]"""
    return (correct & slot_supervised).int().cumprod(-1).sum(-1)


def score_spread(start: Tensor, pair: Tensor) -> Tensor:
    """Per block, the mean of the start scores' std over K and the pair scores' std over K x K (0 = collapse).
    # [A]"""
    if start.shape[-1] < 2:
        return start.new_zeros(start.shape[0])
    spread = _f32(start).std(-1)
    if pair.shape[1]:
        spread = (spread + _f32(pair).flatten(2).std(-1).mean(-1)) / 2
    return spread


class LiLiCorrMetrics(Metric):
    """The walk's accepted prefix on the training lattice, the unary argmax's and the oracle's (label anywhere in
    the lattice), recall@K and the score spread; blocks count where slot 1 is supervised, as DraftMetrics' tau."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("walk", "argmax", "oracle", "blocks", "recalled", "slots", "spread"):
            self.add_state(name, torch.zeros(()), dist_reduce_fx="sum")

    def update(self, rows: tuple[Tensor, Tensor, Tensor], labels: Tensor, supervised: Tensor) -> None:
        """One batch: rows = (start `[A, K]`, pair `[A, S-1, K, K]`, candidate ids `[A, S, K]`) of the part's loss,
        `labels [A, B]` and section 4's mask `[A, B]` (slot 0 never counts)."""
        start, pair, candidates = (t.detach() for t in rows)
        labels, slot_supervised = labels[:, 1:], supervised[:, 1:]
        walk = candidates.gather(-1, greedy_walk(start, pair)[..., None])[..., 0]  # [A, S] token ids
        in_lattice = (candidates == labels[..., None]).any(-1)
        block = slot_supervised[:, 0]
        for name, correct in (("walk", walk == labels), ("argmax", candidates[..., 0] == labels),
                              ("oracle", in_lattice)):
            getattr(self, name).add_((accepted_prefix(correct, slot_supervised) * block).sum())
        self.blocks += block.sum()
        self.recalled += (in_lattice & slot_supervised).sum()
        self.slots += slot_supervised.sum()
        self.spread += (score_spread(start, pair) * block).sum()

    def compute(self) -> dict[str, Tensor]:
        blocks = self.blocks.clamp_min(1)
        return {"lilicorr/tau": 1 + self.walk / blocks, "lilicorr/argmax_tau": 1 + self.argmax / blocks,
                "lilicorr/oracle_tau": 1 + self.oracle / blocks,
                "lilicorr/recall": self.recalled / self.slots.clamp_min(1), "lilicorr/spread": self.spread / blocks}


__all__ = [
    "GEOMETRY", "LatticeLoss", "LiLiCorrMetrics", "LiLiCorrReranker", "LiLiCorrSettings", "attention_bias",
    "candidate_features", "candidate_log_probs", "greedy_walk", "lattice_loss", "sampled_walk", "supervised_slots",
    "target_candidate_logits", "teacher_rows", "weight_shapes",
]
