"""The candidate selector (docs/method.md section 10): re-ranks each slot's unary top K with a bilinear term in
the token before the slot.

`score(c) = u[c] + sum_r P[prev, r] * (W h)[r] * S[c, r]`, teacher-forced in training (the label injected as
the K-th candidate where absent; its K-way CE joins the unary loss inside the chunked head loop, with hand-made
gradients of P, S and W), greedy or sampled slot by slot in decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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


@dataclass
class SelectorSettings:
    """Shape and loss weight of the candidate selector (`model.drafter.selector.*`)."""

    rank: int = 256
    """Rank r of the predecessor and successor codebooks (dflash_config selector_rank)."""
    top_k: int = 16
    """Candidates K re-ranked per slot, the unary top K (dflash_config selector_top_k)."""
    loss_weight: float = 1.0
    """Weight alpha of the selector's K-way CE beside the unary loss (a training choice, not exported)."""

    def check(self, config: Any) -> None:
        """Raise ConfigError naming the field of a value that cannot work for the drafter `config`."""
        if self.rank < 1:
            raise ConfigError(f"selector.rank must be >= 1, got {self.rank}")
        if not 2 <= self.top_k <= (config.vocab_size or self.top_k):
            vocab = f" ({config.vocab_size})" if config.vocab_size else ""
            raise ConfigError(f"selector.top_k must be in 2..vocab_size{vocab}, got {self.top_k}")
        if not self.loss_weight >= 0:
            raise ConfigError(f"selector.loss_weight must be >= 0, got {self.loss_weight}")


class CandidateSelector(Part):
    """Re-ranks a slot's unary top K: `score(c) = u[c] + sum_r P[prev, r] * (W h)[r] * S[c, r]`."""

    name = "selector"
    settings_type = SelectorSettings
    legacy_fields: ClassVar[dict[str, str]] = {"selector_rank": "rank", "selector_top_k": "top_k"}
    legacy_record: ClassVar[dict[str, str]] = {"model.selector_alpha": "loss_weight"}  # once a module argument
    config_fields: ClassVar[dict[str, str]] = {"selector_rank": "rank", "selector_top_k": "top_k"}
    weight_prefix = "candidate_selector"
    decodes = True
    opd_refusal = ("drafts by a K-way choice among the unary top K: its draft distribution is 0 outside those K "
                   "tokens, where the forward KL to the target is infinite")
    head_rows = 1
    fp8_exempt = True  # the loss reads hidden_projection's weight by hand

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        v, r = config.vocab_size, self.settings.rank
        self.top_k = self.settings.top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(v, r))  # P [V, r]
        self.successor_codebook = nn.Parameter(torch.empty(v, r))  # S [V, r]
        self.hidden_projection = nn.Linear(config.hidden_size, r, bias=False)  # W
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(p, std=std)

    # --- training: inside the head loop, with hand-made gradients of P, S and W
    def head_params(self) -> tuple[Tensor, ...]:
        return self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight

    def head_inputs(self, batch: TrainInputs) -> tuple[Tensor, ...]:
        """The token before each row (slot 1: the anchor's), the selector's `prev` under teacher forcing."""
        return (batch.input_ids[batch.before[:, 1:].flatten()],)

    def head_chunk(self, chunk: HeadChunk) -> ChunkResult:
        """The selector's term over one chunk of rows, teacher-forced (docs/method.md section 10).

        The candidates are the unary top K (no gradient) with the label put in place of the K-th where absent;
        adds alpha * dCE/du into `d_logits` (before the rows' weights apply, as the unary term's), accumulates the
        weighted gradients of P, S and W, and returns alpha * sum(w * CE_sel), sum(w * CE_sel), the hidden-state
        gradient through W and per row (label in top K, the selector's pick right) `[R, 2]`.
        """
        alpha, logits, labels, w = self.settings.loss_weight, chunk.logits, chunk.labels, chunk.weights
        (prev,) = chunk.rows
        predecessor, successor, projection = self.head_params()
        with torch.autocast(logits.device.type, enabled=False):
            candidates = chunk.top_ids[:, : self.top_k]
            in_top = (candidates == labels[:, None]).any(-1)  # [R]
            candidates = candidates.clone()
            candidates[:, -1] = torch.where(in_top, candidates[:, -1], labels)
            target = (candidates == labels[:, None]).int().argmax(-1, keepdim=True)  # [R, 1] the label's place
            dt = logits.dtype  # fp32 (fp64 in the tests): the selector's few numbers are reduced as the logits are
            e = predecessor[prev].to(dt)  # [R, r]
            g = F.linear(chunk.hidden.to(dt), projection.to(dt))  # [R, r]
            s = successor[candidates].to(dt)  # [R, K, r]
            score = logits.gather(1, candidates) + torch.einsum("nr,nkr->nk", e * g, s)  # [R, K]
            lse = torch.logsumexp(score, -1, keepdim=True)
            ce = (lse - score.gather(1, target))[:, 0]  # [R]
            d_score = torch.exp(score - lse)
            d_score.scatter_add_(1, target, -torch.ones_like(target, dtype=d_score.dtype))  # softmax - onehot
            chunk.d_logits.scatter_add_(1, candidates, alpha * d_score)  # u[c] is the unary logit: its gradient too
            d_score = d_score * (alpha * w)[:, None]  # d (alpha * sum w * CE_sel) / d score
            d_eg = torch.einsum("nk,nkr->nr", d_score, s)  # [R, r]
            grad_p, grad_s, grad_w = chunk.grads
            grad_s.index_add_(0, candidates.flatten(), (d_score[:, :, None] * (e * g)[:, None, :]).flatten(0, 1))
            grad_p.index_add_(0, prev, d_eg * g)
            d_g = d_eg * e  # [R, r]
            grad_w.add_(d_g.T @ chunk.hidden.to(dt))
            right = in_top & (score.argmax(-1) == target[:, 0])
            sel_ce = (ce * w).sum()
            return ChunkResult(loss=alpha * sel_ce, logged=sel_ce, grad_hidden=d_g @ projection.to(dt),
                               rows=(torch.stack([in_top, right], -1),))

    def loss(self, batch: TrainInputs, head: HeadOutput | None, settings: Any) -> PartOutput:
        hits = head.rows[0].unflatten(0, (-1, batch.labels.shape[1] - 1))  # [A, B-1, 2]
        hits = torch.cat([torch.zeros_like(hits[:, :1]), hits], 1)  # slot 0 (the anchor) never counts
        return PartOutput(logs={"selector/loss": head.logged}, rows=hits)

    @classmethod
    def metric(cls, block_size: int) -> Metric:
        return SelectorMetrics(block_size)

    # --- decoding
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

    def draft(self, inputs: DraftInputs) -> Draft:
        if inputs.temperature == 0:
            return Draft(self.greedy(inputs.hidden, inputs.logits, inputs.first_prev))
        return Draft(*self.sample(inputs.hidden, inputs.logits, inputs.first_prev, inputs.temperature,
                                  inputs.generator))

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


class SelectorMetrics(Metric):
    """Label recall in the unary top K, the selector's teacher-forced accuracy where the label was a candidate
    (training injects it, serving cannot), and the accepted prefix along its picks."""

    full_state_update = False

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("slots", torch.zeros(block_size), dist_reduce_fx="sum")  # [B]
        self.add_state("recalled", torch.zeros(block_size), dist_reduce_fx="sum")  # [B]
        self.add_state("picked", torch.zeros(block_size), dist_reduce_fx="sum")  # [B]
        self.add_state("accepted", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("blocks", torch.zeros(()), dist_reduce_fx="sum")

    def update(self, hits: Tensor, labels: Tensor, supervised: Tensor) -> None:
        """`hits [A, B, 2]`: per slot, (label in the unary top K, the selector's pick right)."""
        recalled, picked = (hits[..., 0] & supervised), (hits[..., 1] & supervised)
        valid_block = supervised[:, 1]
        self.slots += supervised.sum(0).float()
        self.recalled += recalled.sum(0).float()
        self.picked += picked.sum(0).float()
        self.accepted += (picked[:, 1:].int().cumprod(-1).sum(-1) * valid_block).sum().float()
        self.blocks += valid_block.sum().float()

    def compute(self) -> dict[str, Tensor]:
        return {
            "selector/recall": self.recalled[1:].sum() / self.slots[1:].sum().clamp_min(1),
            "selector/acc": self.picked[1:].sum() / self.recalled[1:].sum().clamp_min(1),
            "selector/tau": 1 + self.accepted / self.blocks.clamp_min(1),
        }


__all__ = ["CandidateSelector", "SelectorMetrics", "SelectorSettings"]
