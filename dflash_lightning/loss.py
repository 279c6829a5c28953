"""The training objective through the frozen target head, in chunks (docs/method.md sections 4, 4b, 4c and 8).

The head is frozen, so only the gradient with respect to the drafter's hidden states is needed: it is
computed chunk by chunk in the forward pass, and no `[A*B, vocab]` fp32 tensor ever exists whole. The
head's matmuls can run in FP8 with the head pre-quantized once (`dflash_lightning.fp8.quantize_frozen`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_lightning.blocks import dpace_weights
from dflash_lightning.config import ConfigError
from dflash_lightning.dflash2 import unary_top_k

if TYPE_CHECKING:
    from dflash_lightning.dflash2 import CandidateSelector

OBJECTIVES = ("ce", "kl", "ce+kl")
LOSS_WEIGHTS = ("decay", "dpace")


@dataclass(frozen=True)
class LossSettings:
    """What the head loss computes: objective, slot weighting and distillation temperature."""

    objective: Literal["ce", "kl", "ce+kl"] = "ce"
    """ce: against the data tokens; kl: KL(target || drafter) of the target's own distribution; ce+kl: both."""
    loss_weights: Literal["decay", "dpace"] = "dpace"
    """decay: w_k = exp(-(k-1)/gamma); dpace: from each step's per-slot CE (docs/method.md section 4b)."""
    dpace_alpha: float = 0.5
    """D-PACE smoothing, s_k = (1 - alpha) * q_k + alpha."""
    temperature: float = 1.0
    """Distillation temperature tau: KL of softmax(logits / tau), scaled by tau**2."""
    selector_alpha: float = 1.0
    """DFlash2: weight of the candidate selector's K-way CE in the total loss (docs/method.md section 10)."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective must be one of {OBJECTIVES}, got '{self.objective}'")
        if self.loss_weights not in LOSS_WEIGHTS:
            raise ConfigError(f"loss_weights must be one of {LOSS_WEIGHTS}, got '{self.loss_weights}'")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ConfigError(f"dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if not self.selector_alpha >= 0:
            raise ConfigError(f"selector_alpha must be >= 0, got {self.selector_alpha}")

    @property
    def distills(self) -> bool:
        """Whether the target's final hidden state is needed (the teacher of section 4c)."""
        return self.objective != "ce"


class _HeadLoss(torch.autograd.Function):
    """sum(w * objective) over rows of `hidden @ head.T`, with its hidden-state gradient made in the forward pass.

    `head_t` is `head.T` as a weight of `F.linear` (the transposed view, or its own FP8 quantization). DFlash2's
    selector term comes in the same loop (`_selector_chunk`), with the gradients of its three weights.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, head: Tensor, head_t: Tensor, labels: Tensor, weights: Tensor, teacher: Tensor | None,
        teacher_rows: Tensor | None, block_size: int, chunk: int, topk: int, settings: LossSettings,
        prev: Tensor | None, predecessor: Tensor | None, successor: Tensor | None, projection: Tensor | None,
        selector_k: int,
    ):
        n = hidden.shape[0]
        grad = torch.empty_like(hidden)  # [N, H]
        selecting = prev is not None
        if selecting:  # fp32 gradients of the selector's weights, accumulated over chunks
            sel_grads = [torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)
                         for p in (predecessor, successor, projection)]
            sel_total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
            sel_hits = torch.empty(n, 2, dtype=torch.bool, device=hidden.device)  # [N, (in top K, pick right)]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits are reduced in fp32
        total = torch.zeros((), dtype=acc, device=hidden.device)
        ce_total = torch.zeros((), dtype=acc, device=hidden.device)
        used = torch.empty(n, dtype=acc, device=hidden.device)  # [N] the weights this step used
        ce_coef = 0.0 if settings.objective == "kl" else 1.0
        tau = settings.temperature
        top = []
        rows = max(1, chunk // block_size) * block_size  # whole blocks: D-PACE needs every slot of a block
        for start in range(0, n, rows):
            end = min(start + rows, n)
            h, y = hidden[start:end].to(head.dtype), labels[start:end, None]
            raw = F.linear(h, head)  # [rows, V] in the compute dtype
            ranked = max(topk, selector_k if selecting else 0)  # one topk serves the metrics and the candidates
            # ranked on the compute-dtype logits (bf16 under bf16-mixed): half the bytes of fp32 ones to read
            top_ids = unary_top_k(raw, ranked) if ranked else None
            logits = raw.to(acc)
            del raw
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            ce = (lse - logits.gather(1, y))[:, 0]  # [rows]
            if settings.loss_weights == "dpace":
                supervised = (weights[start:end] > 0).view(-1, block_size)
                w = dpace_weights(ce.view(-1, block_size), supervised, settings.dpace_alpha).flatten().to(acc)
            else:
                w = weights[start:end].to(acc)
            used[start:end] = w
            ce_total = ce_total + (ce * w).sum()
            if topk:
                top.append(top_ids[:, :topk])
            probs = torch.exp(logits - lse)
            d_logits, row_loss = None, ce * ce_coef  # d objective / d logits, per row  # [rows, V]
            if settings.distills:
                t_logits = F.linear(teacher[teacher_rows[start:end]].to(head.dtype), head).to(acc) / tau  # [rows, V]
                log_p = t_logits - torch.logsumexp(t_logits, dim=-1, keepdim=True)
                if tau == 1.0:
                    log_q, q = logits - lse, probs
                else:
                    s_logits = logits / tau
                    log_q = s_logits - torch.logsumexp(s_logits, dim=-1, keepdim=True)
                    q = torch.exp(log_q)
                p = torch.exp(log_p)
                # tau**2 keeps the gradient's scale independent of the temperature (Hinton et al.).
                row_loss = row_loss + tau * tau * (p * (log_p - log_q)).sum(-1)
                d_logits = tau * (q - p)
            if ce_coef:  # softmax - onehot, added in place last: nothing reads probs after it
                d_logits = probs if d_logits is None else d_logits.add_(probs)
                d_logits.scatter_add_(1, y, -torch.ones_like(probs[:, :1]))
            total = total + (row_loss * w).sum()
            grad_rows = None
            if selecting:
                sel_ce, grad_rows, hits = _selector_chunk(
                    logits, h, y[:, 0], prev[start:end], w, top_ids[:, :selector_k], predecessor, successor,
                    projection, settings.selector_alpha, d_logits, sel_grads,
                )
                sel_total = sel_total + sel_ce
                total = total + settings.selector_alpha * sel_ce
                sel_hits[start:end] = hits
            g = F.linear((d_logits * w[:, None]).to(head.dtype), head_t)
            grad[start:end] = (g if grad_rows is None else g.to(grad_rows.dtype) + grad_rows).to(grad.dtype)
        top_ids = torch.cat(top) if topk else labels.new_empty(n, 0)
        if not selecting:
            ctx.save_for_backward(grad)
            ctx.mark_non_differentiable(ce_total, used, top_ids)
            return total, ce_total, used, top_ids
        ctx.save_for_backward(grad, *sel_grads)
        ctx.param_dtypes = (predecessor.dtype, successor.dtype, projection.dtype)
        ctx.mark_non_differentiable(ce_total, used, top_ids, sel_total, sel_hits)
        return total, ce_total, used, top_ids, sel_total, sel_hits

    @staticmethod
    def backward(ctx, grad_loss: Tensor, *_grad_rest: Tensor):
        grad, *sel_grads = ctx.saved_tensors
        scale = grad_loss.float()
        out = [grad * grad_loss.to(grad.dtype), *[None] * 11]
        if not sel_grads:
            return (*out, None, None, None, None)
        dtypes = ctx.param_dtypes
        return (*out, *[(g * scale).to(dtype) for g, dtype in zip(sel_grads, dtypes, strict=True)], None)


def _selector_chunk(
    logits: Tensor, hidden: Tensor, labels: Tensor, prev: Tensor, w: Tensor, candidates: Tensor,
    predecessor: Tensor, successor: Tensor, projection: Tensor, alpha: float, d_logits: Tensor,
    sel_grads: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate selector's term over one chunk of rows, teacher-forced (docs/method.md section 10).

    The candidates are the unary top K (`candidates [R, K]`, no gradient) with the label put in place of the K-th
    where absent; `score = u[c] + (P[prev] * (W h)) . S[c]`. Adds alpha * dCE/du into `d_logits` (before the rows'
    weights are applied, as the unary term's), accumulates the gradients of P, S and W (weighted) into `sel_grads`,
    and returns sum(w * CE_sel), the hidden-state gradient through W `[R, H]` and per row (label in top K, the
    selector's pick right) `[R, 2]`.
    """
    with torch.autocast(logits.device.type, enabled=False):
        in_top = (candidates == labels[:, None]).any(-1)  # [R]
        candidates = candidates.clone()
        candidates[:, -1] = torch.where(in_top, candidates[:, -1], labels)
        target = (candidates == labels[:, None]).int().argmax(-1, keepdim=True)  # [R, 1] the label's place
        dt = logits.dtype  # fp32 (fp64 in the tests): the selector's few numbers are reduced as the logits are
        e = predecessor[prev].to(dt)  # [R, r]
        g = F.linear(hidden.to(dt), projection.to(dt))  # [R, r]
        s = successor[candidates].to(dt)  # [R, K, r]
        score = logits.gather(1, candidates) + torch.einsum("nr,nkr->nk", e * g, s)  # [R, K]
        lse = torch.logsumexp(score, -1, keepdim=True)
        ce = (lse - score.gather(1, target))[:, 0]  # [R]
        d_score = torch.exp(score - lse)
        d_score.scatter_add_(1, target, -torch.ones_like(target, dtype=d_score.dtype))  # softmax - onehot
        d_logits.scatter_add_(1, candidates, alpha * d_score)  # u[c] is the unary logit: its gradient joins theirs
        d_score = d_score * (alpha * w)[:, None]  # d (alpha * sum w * CE_sel) / d score
        d_eg = torch.einsum("nk,nkr->nr", d_score, s)  # [R, r]
        grad_p, grad_s, grad_w = sel_grads
        grad_s.index_add_(0, candidates.flatten(), (d_score[:, :, None] * (e * g)[:, None, :]).flatten(0, 1))
        grad_p.index_add_(0, prev, d_eg * g)
        d_g = d_eg * e  # [R, r]
        grad_w.add_(d_g.T @ hidden.to(dt))
        right = in_top & (score.argmax(-1) == target[:, 0])
        return (ce * w).sum(), d_g @ projection.to(dt), torch.stack([in_top, right], -1)


def chunked_head_loss(
    hidden: Tensor, head: Tensor, labels: Tensor, weights: Tensor, chunk: int = 4096, topk: int = 0,
    block_size: int = 1, settings: LossSettings = LossSettings(),  # noqa: B008 (frozen)
    teacher: Tensor | None = None, teacher_rows: Tensor | None = None, head_t: Tensor | None = None,
    selector: tuple[CandidateSelector, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:
    """sum(w * objective), sum(w * CE), the weights `[N]`, top-k ids `[N, k]` and the selector's (sum(w * CE_sel),
    hits `[N, 2]`) over rows `hidden [N, H]`.

    Rows are blocks of `block_size` slots. `weights` are the decay weights, or for D-PACE any weights whose
    non-zeros mark the supervised slots. With distillation, teacher row i is `teacher[teacher_rows[i]]`
    (the target's final hidden states). The caller divides the sums by the (global) weight sum. An FP8 head
    comes as `head` and `head_t`, the quantized `[V, H]` head and its quantized transpose. DFlash2's `selector` is
    the drafter's `CandidateSelector` and the token before each row `[N]`; its term joins the objective,
    `+ alpha * sum(w * CE_sel)`.
    """
    if settings.distills and (teacher is None or teacher_rows is None):
        raise ValueError(f"objective '{settings.objective}' needs the target's final hidden states (teacher)")
    if hidden.shape[0] % block_size:
        raise ValueError(f"{hidden.shape[0]} rows are not whole blocks of {block_size}")
    if head_t is None:
        head = head.to(hidden.dtype)
        head_t = head.T
    teacher = teacher.to(hidden.dtype) if settings.distills else None
    rows = teacher_rows if settings.distills else None
    if selector is None:
        total, ce, used, top = _HeadLoss.apply(
            hidden, head, head_t, labels, weights, teacher, rows, block_size, chunk, topk, settings,
            None, None, None, None, 0,
        )
        return total, ce, used, (top if topk else None), None
    module, prev = selector
    params = (module.predecessor_codebook, module.successor_codebook, module.hidden_projection.weight)
    total, ce, used, top, sel_ce, hits = _HeadLoss.apply(
        hidden, head, head_t, labels, weights, teacher, rows, block_size, chunk, topk, settings, prev, *params,
        module.top_k,
    )
    return total, ce, used, (top if topk else None), (sel_ce, hits)


def rank_mean_weight(weights: Tensor) -> Tensor:
    """sum(w) averaged over data-parallel ranks, so that DDP's gradient mean is sum(w * CE) / sum(w) globally.

    Without it each rank would normalise by its own weights, and the loss would depend on the rank count.
    """
    import torch.distributed as dist

    total = weights.sum()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return total
    total = total.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()
