"""The unary top K of head logits, read by the loss's chunked head loop and by the parts that rank candidates."""

from __future__ import annotations

import torch
from torch import Tensor

TOP_K_GROUP = 256  # columns per group of unary_top_k's first pass


def unary_top_k(logits: Tensor, k: int, group: int = TOP_K_GROUP) -> Tensor:
    """Ids of the k largest logits of each row `[N, V]`, largest first: torch.topk's set in two cheap passes.

    Every top-k entry lies in one of the k groups (of `group` columns) with the largest maxima, so a max per group,
    a top k of the maxima, and a top k within those k groups (plus the tail past the last whole group) find it;
    on 152K columns that reads the logits once instead of a radix select's several passes.  # [N, k]
    """
    n, v = logits.shape
    whole = v // group
    if k == 0 or v < 8 * k * group:
        return logits.topk(k, dim=-1).indices
    grouped = logits[:, : whole * group].unflatten(1, (whole, group))  # [N, G, group]
    groups = grouped.amax(-1).topk(k, dim=-1).indices  # [N, k]
    inside = grouped.gather(1, groups[:, :, None].expand(n, k, group)).flatten(1)  # [N, k * group]
    pick = torch.cat([inside, logits[:, whole * group :]], 1).topk(k, dim=-1).indices  # [N, k]
    in_groups = pick < k * group
    column = groups.gather(1, (pick // group).clamp(max=k - 1)) * group + pick % group
    return torch.where(in_groups, column, pick - k * group + whole * group)


__all__ = ["TOP_K_GROUP", "unary_top_k"]
