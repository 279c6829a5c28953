"""Weighted cross-entropy through the frozen target head, in chunks (DFLASH.md sections 4 and 8).

The head is frozen, so only the gradient with respect to the drafter's hidden states is needed: it is
computed chunk by chunk in the forward pass, and no `[A*B, vocab]` fp32 tensor ever exists whole.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _HeadCrossEntropy(torch.autograd.Function):
    """sum(w * CE(hidden @ head.T, labels)) with its hidden-state gradient made in the forward pass."""

    @staticmethod
    def forward(ctx, hidden: Tensor, head: Tensor, labels: Tensor, weights: Tensor, chunk: int, topk: int):
        n = hidden.shape[0]
        grad = torch.empty_like(hidden)  # [N, H]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits are reduced in fp32
        total = torch.zeros((), dtype=acc, device=hidden.device)
        top = []
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h, y, w = hidden[start:end], labels[start:end, None], weights[start:end, None].to(acc)
            logits = (h @ head.T).to(acc)  # [chunk, V]
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            total = total + ((lse - logits.gather(1, y)) * w).sum()
            if topk:
                top.append(logits.topk(topk, dim=-1).indices)
            probs = torch.exp(logits - lse)
            probs.scatter_add_(1, y, -torch.ones_like(probs[:, :1]))  # softmax - onehot
            grad[start:end] = ((probs * w).to(head.dtype) @ head).to(grad.dtype)
        ctx.save_for_backward(grad)
        top_ids = torch.cat(top) if topk else labels.new_empty(n, 0)
        ctx.mark_non_differentiable(top_ids)
        return total, top_ids

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_top: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def chunked_head_loss(
    hidden: Tensor, head: Tensor, labels: Tensor, weights: Tensor, chunk: int = 4096, topk: int = 0,
    denominator: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Loss sum(w * CE) / denominator over rows `hidden [N, H]`, plus the top-k token ids `[N, k]` if asked.

    The denominator defaults to sum(w); data-parallel training passes `rank_mean_weight(weights)`.
    """
    denominator = weights.sum() if denominator is None else denominator
    norm = weights / denominator.clamp_min(1e-12)
    loss, top = _HeadCrossEntropy.apply(hidden, head.to(hidden.dtype), labels, norm, chunk, topk)
    return loss, (top if topk else None)


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
