"""The training objective through the frozen target head, in chunks (docs/method.md sections 4, 4b, 4c and 8).

The head is frozen, so only the gradient with respect to the drafter's hidden states is needed: it is
computed chunk by chunk in the forward pass, and no `[A*B, vocab]` fp32 tensor ever exists whole. The
head's matmuls can run in FP8 with the head pre-quantized once (`dflash_lightning.fp8.quantize_frozen`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_lightning.blocks import dpace_weights
from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.base import HeadChunk, Part
from dflash_lightning.parts.topk import unary_top_k

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

    def __post_init__(self) -> None:
        if any(isinstance(value, torch.fx.Proxy) for value in vars(self).values()):
            # torch 2.7's Dynamo rebuilds these settings from traced values when it recompiles for a new
            # temperature; the settings it copies were checked when made
            return
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective must be one of {OBJECTIVES}, got '{self.objective}'")
        if self.loss_weights not in LOSS_WEIGHTS:
            raise ConfigError(f"loss_weights must be one of {LOSS_WEIGHTS}, got '{self.loss_weights}'")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ConfigError(f"dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        if not 0 < self.temperature < math.inf:
            raise ConfigError(f"temperature must be > 0 and finite, got {self.temperature}")

    @property
    def distills(self) -> bool:
        """Whether the target's final hidden state is needed (the teacher of section 4c)."""
        return self.objective != "ce"


class _HeadLoss(torch.autograd.Function):
    """sum(w * objective) over rows of `hidden @ head.T`, with its hidden-state gradient made in the forward pass.

    `head_t` is `head.T` as a weight of `F.linear` (the transposed view, or its own FP8 quantization). The parts
    with head inputs work in the same loop (`Part.head_chunk`), with the gradients of their `head_params` and of
    their inputs that require one. `tensors` are every part's inputs, then every part's `head_params`, flat
    (autograd sees them): `counts` holds how many inputs and params each part has, `needs` which inputs take a
    gradient.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, head: Tensor, head_t: Tensor, labels: Tensor, weights: Tensor, teacher: Tensor | None,
        teacher_rows: Tensor | None, block_size: int, chunk: int, topk: int, settings: LossSettings,
        parts: tuple[Part, ...], counts: tuple[tuple[int, int], ...], needs: tuple[bool, ...], *tensors: Tensor,
    ):
        n = hidden.shape[0]
        n_inputs = sum(i for i, _ in counts)
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        grad = torch.empty_like(hidden)  # [N, H]
        # fp32 gradients of the parts' own weights, accumulated over chunks, and of their inputs that need one
        part_grads = [torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)
                      for p in params]
        input_grads = [torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)
                       if need else None for t, need in zip(inputs, needs, strict=True)]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits are reduced in fp32
        logged = [torch.zeros((), dtype=acc, device=hidden.device) for _ in parts]
        part_out: list[list[list[Tensor]]] = [[[] for _ in range(part.head_rows)] for part in parts]
        total = torch.zeros((), dtype=acc, device=hidden.device)
        ce_total = torch.zeros((), dtype=acc, device=hidden.device)
        used = torch.empty(n, dtype=acc, device=hidden.device)  # [N] the weights this step used
        ce_coef = 0.0 if settings.objective == "kl" else 1.0
        scale = 1.0  # the loop's own term beside the parts' (`Part.objective_weight`)
        for part in parts:
            scale *= part.objective_weight()
        corrects = any(_corrects(part) for part in parts)  # then it is the loop's only part (chunked_head_loss)
        tau = settings.temperature
        top = []
        rows = max(1, chunk // block_size) * block_size  # whole blocks: D-PACE needs every slot of a block
        ranked = max(topk, *(part.top_k for part in parts), 0)  # one topk serves the metrics and the parts

        def piece(t: Tensor, start: int, end: int) -> Tensor:
            """A part input's share of rows start:end: those rows, those blocks, or the whole of a 0-dim one."""
            if t.ndim == 0:
                return t
            return t[start:end] if t.shape[0] == n else t[start // block_size : end // block_size]

        # where each part's inputs and params start in `inputs` and `params`
        i_first, p_first = [0], [0]  # a plain loop: torch 2.7's Dynamo refuses itertools.accumulate(initial=)
        for k_inputs, k_params in counts:
            i_first.append(i_first[-1] + k_inputs)
            p_first.append(p_first[-1] + k_params)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            h, y = hidden[start:end].to(head.dtype), labels[start:end, None]
            mine = [tuple(piece(t, start, end) for t in inputs[i_first[i] : i_first[i + 1]])
                    for i in range(len(parts))]
            raw = F.linear(h, head)  # [rows, V] in the compute dtype
            for i, part in enumerate(parts):  # a part's term of the logits themselves (DSpark's Markov head)
                bias = part.logit_bias(mine[i], raw)
                if bias is not None:
                    raw = raw + bias
            fix = parts[0].logit_correction(mine[0], h, raw) if corrects else None  # f = b + c served (Domino)
            lam = None if fix is None else torch.as_tensor(fix.base_weight, dtype=acc, device=raw.device)
            base = base_ce = base_ids = base_lse = None
            if fix is None:
                # ranked on the compute-dtype logits (bf16 under bf16-mixed): half the bytes of fp32 ones to read
                top_ids = unary_top_k(raw, ranked) if ranked else None
                logits = raw.to(acc)
                del raw
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                ce = (lse - logits.gather(1, y))[:, 0]  # [rows]
            else:  # b kept, f = b + c made in fp32 (c's buffer, in place) and ranked there; two [rows, V] buffers,
                # each made its softmax in place (no logsumexp temporary), later its gradient
                base = raw.to(acc)  # [rows, V] b
                del raw
                logits = fix.logits.to(acc).add_(base)  # [rows, V] f
                fix = None
                top_ids = unary_top_k(logits, ranked) if ranked else None
                picked, base_picked, base_ids = logits.gather(1, y), base.gather(1, y), base.argmax(-1)
                lse, base_lse = _softmax_(logits), _softmax_(base)
                ce, base_ce = (lse - picked)[:, 0], (base_lse - base_picked)[:, 0]  # [rows] each
            if settings.loss_weights == "dpace":
                supervised = (weights[start:end] > 0).view(-1, block_size)
                w = dpace_weights(ce.view(-1, block_size), supervised, settings.dpace_alpha).flatten().to(acc)
            else:
                w = weights[start:end].to(acc)
            used[start:end] = w
            ce_total = ce_total + (ce * w).sum()
            if topk:
                top.append(top_ids[:, :topk])
            d_fix = None
            if base is not None:
                row_loss = scale * ((1 - lam) * ce + lam * base_ce)
                # the softmaxes turned into gradients in place: f -> d/dc, b -> d/db = d/dc + lambda (softmax b - 1)
                d_fix, d_logits, logits, base = logits, base, None, None
                if scale == 0:
                    d_fix.zero_()
                    d_logits.zero_()
                else:
                    d_fix.scatter_add_(1, y, torch.full_like(lse, -1.0)).mul_(scale * (1 - lam))
                    d_logits.scatter_add_(1, y, torch.full_like(lse, -1.0)).mul_(scale * lam).add_(d_fix)
            elif scale == 0:  # the loop's own objective is not wanted: the parts' terms start from zero
                row_loss = torch.zeros_like(ce)
                d_logits = torch.zeros_like(logits) if parts else None
            else:
                probs = torch.exp(logits - lse)
                d_logits, row_loss = None, ce * ce_coef  # d objective / d logits, per row  # [rows, V]
                if settings.distills:
                    t_logits = F.linear(teacher[teacher_rows[start:end]].to(head.dtype), head).to(acc) / tau
                    log_p = t_logits - torch.logsumexp(t_logits, dim=-1, keepdim=True)  # [rows, V]
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
                if scale != 1.0:
                    row_loss = row_loss * scale
                    d_logits = d_logits.mul_(scale) if d_logits is not None else None
            total = total + (row_loss * w).sum()
            grad_rows = None
            for i, part in enumerate(parts):
                view = HeadChunk(
                    start=start, end=end, hidden=h, logits=logits, lse=lse, labels=y[:, 0], weights=w,
                    top_ids=top_ids, d_logits=d_logits, head=head, head_t=head_t, rows=mine[i],
                    grads=part_grads[p_first[i] : p_first[i + 1]], ce=ce, d_correction=d_fix,
                    base_ce=base_ce, base_ids=base_ids,
                )
                result = part.head_chunk(view)
                if result.loss is not None:
                    total = total + result.loss
                if result.logged is not None:
                    logged[i] = logged[i] + result.logged
                if result.grad_hidden is not None:
                    grad_rows = result.grad_hidden if grad_rows is None else grad_rows + result.grad_hidden
                for j, g_in in enumerate(result.grad_inputs):
                    kept = input_grads[i_first[i] + j]
                    if g_in is not None and kept is not None:  # disjoint pieces: adding is writing
                        piece(kept, start, end).add_(g_in.to(kept.dtype))
                for kept, row in zip(part_out[i], result.rows, strict=True):
                    kept.append(row)
            view = d_fix = None  # d/dc is read: free it before the head's matmul
            # the rows' weights applied in place: nothing reads d_logits after the parts
            g = None if d_logits is None else F.linear(d_logits.mul_(w[:, None]).to(head.dtype), head_t)
            if g is None and grad_rows is None:
                grad[start:end] = 0
            elif grad_rows is None:
                grad[start:end] = g.to(grad.dtype)
            else:
                grad[start:end] = (grad_rows if g is None else g.to(grad_rows.dtype) + grad_rows).to(grad.dtype)
            logits = d_logits = probs = None  # this chunk's [rows, V] buffers, freed before the next chunk's are made
        top_ids = torch.cat(top) if topk else labels.new_empty(n, 0)
        out_rows = [torch.cat(r) for kept in part_out for r in kept]
        kept_inputs = [g for g in input_grads if g is not None]
        ctx.save_for_backward(grad, *part_grads, *kept_inputs)
        ctx.param_dtypes = tuple(p.dtype for p in params)
        ctx.input_dtypes = tuple(t.dtype for t in inputs)
        ctx.needs = needs
        ctx.n_inputs = 14
        ctx.mark_non_differentiable(ce_total, used, top_ids, *logged, *out_rows)
        return total, ce_total, used, top_ids, *logged, *out_rows

    @staticmethod
    def backward(ctx, grad_loss: Tensor, *_grad_rest: Tensor):
        grad, *saved = ctx.saved_tensors
        n_params = len(ctx.param_dtypes)
        part_grads, kept_inputs = saved[:n_params], iter(saved[n_params:])
        scale = grad_loss.float() if grad_loss.dtype != torch.float64 else grad_loss
        out = [grad * grad_loss.to(grad.dtype), *[None] * (ctx.n_inputs - 1)]
        inputs = [(next(kept_inputs) * scale).to(dtype) if need else None
                  for need, dtype in zip(ctx.needs, ctx.input_dtypes, strict=True)]
        params = [(g * scale).to(dtype) for g, dtype in zip(part_grads, ctx.param_dtypes, strict=True)]
        return (*out, *inputs, *params)


def _softmax_(logits: Tensor) -> Tensor:
    """Turn rows of `logits [R, V]` into their softmax IN PLACE; their logsumexp `[R, 1]`."""
    top = logits.amax(-1, keepdim=True)
    total = logits.sub_(top).exp_().sum(-1, keepdim=True)
    logits.div_(total)
    return top + total.log()


def _corrects(part: Part) -> bool:
    """Whether a part corrects the loop's logits (`Part.logit_correction`)."""
    return type(part).logit_correction is not Part.logit_correction


def chunked_head_loss(
    hidden: Tensor, head: Tensor, labels: Tensor, weights: Tensor, chunk: int = 4096, topk: int = 0,
    block_size: int = 1, settings: LossSettings = LossSettings(),  # noqa: B008 (frozen)
    teacher: Tensor | None = None, teacher_rows: Tensor | None = None, head_t: Tensor | None = None,
    parts: tuple[tuple[Part, tuple[Tensor, ...]], ...] = (),
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[tuple[Tensor, tuple[Tensor, ...]]]]:
    """sum(w * objective), sum(w * CE), the weights `[N]`, top-k ids `[N, k]` and, per part, (the sum of its
    `ChunkResult.logged`, its `ChunkResult.rows` of every row, `[N, ...]` each) over rows `hidden [N, H]`.

    Rows are blocks of `block_size` slots. `weights` are the decay weights, or for D-PACE any weights whose
    non-zeros mark the supervised slots. With distillation, teacher row i is `teacher[teacher_rows[i]]`
    (the target's final hidden states). The caller divides the sums by the (global) weight sum, or by a part's
    `loss_denominator`. An FP8 head comes as `head` and `head_t`, the quantized `[V, H]` head and its quantized
    transpose. `parts` are the drafter's parts that work inside the loop, each with its inputs (`Part.head_inputs`:
    per row `[N, ...]`, per block `[N / block_size, ...]` or 0-dim; those that require a gradient get the one
    their `head_chunk` returns); their terms join the objective's sum. A part that corrects the logits
    (`Part.logit_correction`) makes the objective (1 - lambda) objective(f) + lambda objective(b), and sum(w * CE)
    and the top-k are f's.
    """
    if settings.distills and (teacher is None or teacher_rows is None):
        raise ValueError(f"objective '{settings.objective}' needs the target's final hidden states (teacher)")
    n = hidden.shape[0]
    if n % block_size:
        raise ValueError(f"{n} rows are not whole blocks of {block_size}")
    modules = tuple(part for part, _ in parts)
    if any(_corrects(part) for part in modules):
        if len(modules) > 1:  # the logits become its gradient in place: no other part could read them
            raise ValueError(f"a part that corrects the logits works alone in the head loop: "
                             f"{', '.join(type(p).__name__ for p in modules)}")
        if settings.distills:
            raise ValueError(f"objective '{settings.objective}': the head loop corrects the logits under the CE only")
    for part, inputs in parts:
        for t in inputs:
            if t.ndim and t.shape[0] not in (n, n // block_size):
                raise ValueError(f"{type(part).__name__}: a head input of shape {tuple(t.shape)} is neither per row "
                                 f"({n}) nor per block ({n // block_size}) nor 0-dim")
    if head_t is None:
        head = head.to(hidden.dtype)
        head_t = head.T
    teacher = teacher.to(hidden.dtype) if settings.distills else None
    rows = teacher_rows if settings.distills else None
    inputs = [t for _, part_inputs in parts for t in part_inputs]
    params = [p for part in modules for p in part.head_params()]
    counts = tuple((len(part_inputs), len(part.head_params())) for part, part_inputs in parts)
    needs = tuple(t.requires_grad and t.is_floating_point() for t in inputs)
    total, ce, used, top, *rest = _HeadLoss.apply(
        hidden, head, head_t, labels, weights, teacher, rows, block_size, chunk, topk, settings, modules, counts,
        needs, *inputs, *params,
    )
    logged, rows, results = rest[: len(modules)], rest[len(modules):], []
    for part, value in zip(modules, logged, strict=True):
        results.append((value, tuple(rows[: part.head_rows])))
        rows = rows[part.head_rows:]
    return total, ce, used, (top if topk else None), results


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
