"""DFlash2's two modules (docs/method.md section 10): block-local convolutions and the candidate selector.

A DFlash2 drafter is the DFlash drafter with a `BlockConv` around each sublayer of every layer and a
`CandidateSelector` after the final norm; both start as no-ops, so a DFlash checkpoint is a valid warm start.
The selector's training term lives in loss.py (inside the chunked head loop), its decoding here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lightning.config import DrafterConfig

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


class BlockConv(nn.Module):
    """Causal taps over the slots of one block, with per-slot kernels: `conv(x)[t, c] = sum_tau (b[tau, c] +
    d[t, tau, G(c)]) * x[t - tau, c]` for `t - tau >= 0`; a block never reads another block or the context."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, self.k, self.g = config.hidden_size, config.conv_kernel_size, config.conv_group_size
        self.block_size = config.block_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.k, h))  # [2 (in, out), k, H]
        self.kernel_projection = nn.Linear(h, 2 * self.k * (h // self.g), bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of the base kernel 1, every other tap and the projection 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """`conv_out(sublayer(conv_in(x)))` over block tokens `x [A*B, H]` (after the sublayer's input norm)."""
        blocks = x.unflatten(0, (-1, self.block_size))  # [A, B, H]
        d = self.kernel_projection(blocks).unflatten(-1, (2, self.k, -1))  # [A, B, 2, k, H/g]
        inner = sublayer(self.taps(blocks, d[:, :, 0], self.base_kernel[0]).flatten(0, 1))
        return self.taps(inner.unflatten(0, blocks.shape[:2]), d[:, :, 1], self.base_kernel[1]).flatten(0, 1)

    def taps(self, x: Tensor, d: Tensor, base: Tensor) -> Tensor:
        """One convolution of blocks `x [A, B, H]` with dynamic taps `d [A, B, k, H/g]` and base taps `[k, H]`."""
        a, b, h = x.shape
        grouped = (h // self.g, self.g)
        base = base.to(x.dtype).unflatten(-1, grouped)  # [k, H/g, g]
        d = d.to(x.dtype)
        out = torch.zeros_like(x).unflatten(-1, grouped)  # [A, B, H/g, g]
        for tau in range(self.k):
            shifted = F.pad(x, (0, 0, tau, 0))[:, :b].unflatten(-1, grouped)  # slot t reads slot t - tau, 0 before 0
            out = out + (base[tau] + d[:, :, tau, :, None]) * shifted
        return out.flatten(-2)


class CandidateSelector(nn.Module):
    """Re-ranks a slot's unary top K: `score(c) = u[c] + sum_r P[prev, r] * (W h)[r] * S[c, r]`."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        v, r = config.vocab_size, config.selector_rank
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(v, r))  # P [V, r]
        self.successor_codebook = nn.Parameter(torch.empty(v, r))  # S [V, r]
        self.hidden_projection = nn.Linear(config.hidden_size, r, bias=False)  # W
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(p, std=std)

    def _slot_terms(self, hidden: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
        """What a slot's scores need besides prev: W h `[N, r]` and S of its candidates `[N, K, r]`."""
        dt = torch.promote_types(self.successor_codebook.dtype, torch.float32)
        return F.linear(hidden.to(dt), self.hidden_projection.weight.to(dt)), self.successor_codebook[candidates].to(dt)

    def _pair(self, projected: Tensor, successors: Tensor, prev: Tensor) -> Tensor:
        """The bilinear term `(P[prev] * W h) . S[c]` of each row's candidates.  # [N, K]"""
        query = self.predecessor_codebook[prev].to(projected.dtype) * projected  # [N, r]
        return torch.einsum("nr,nkr->nk", query, successors)

    def candidates(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The unary top K of each row of logits `[N, V]`: ids `[N, K]` and their logits `[N, K]` (fp32)."""
        ids = unary_top_k(logits, self.top_k)
        return ids, logits.gather(1, ids).to(torch.promote_types(logits.dtype, torch.float32))

    @torch.no_grad()
    def greedy(self, hidden: Tensor, logits: Tensor, first_prev: Tensor) -> Tensor:
        """Greedy drafts of consecutive slots `hidden [n, H]`, `logits [n, V]`: slot by slot, prev is the token
        before (the block's first token, then each slot's pick).  # [n]"""
        ids, unary = self.candidates(logits)
        projected, successors = self._slot_terms(hidden, ids)  # all slots at once; only prev is sequential
        prev, picks = first_prev.reshape(1), []
        for i in range(ids.shape[0]):
            score = unary[i] + self._pair(projected[i : i + 1], successors[i : i + 1], prev)[0]
            prev = ids[i, score.argmax()].reshape(1)
            picks.append(prev)
        return torch.cat(picks)

    @torch.no_grad()
    def sample(
        self, hidden: Tensor, logits: Tensor, first_prev: Tensor, temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Sampled drafts and their draft distributions q `[n, V]` (softmax(score / T) over each slot's K
        candidates, 0 elsewhere), slot by slot with prev the token sampled for the slot before.  # [n], [n, V]"""
        ids, unary = self.candidates(logits)
        projected, successors = self._slot_terms(hidden, ids)
        prev, picks = first_prev.reshape(1), []
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        for i in range(ids.shape[0]):
            score = unary[i] + self._pair(projected[i : i + 1], successors[i : i + 1], prev)[0]
            probs = torch.softmax(score / temperature, -1)  # [K]
            q[i, ids[i]] = probs
            prev = ids[i, torch.multinomial(probs, 1, generator=generator)].reshape(1)
            picks.append(prev)
        return torch.cat(picks), q


__all__ = ["BlockConv", "CandidateSelector"]
