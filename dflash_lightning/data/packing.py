"""Tokenized documents -> packed rows of exactly `token_budget` tokens (one row is one training batch).

Best-fit-decreasing over a shuffle buffer chooses which documents share a row; `collate_documents`
lays a row out in the fixed-shape `PackedBatch` that the model reads.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, insort
from collections.abc import Sequence
from typing import TypedDict

import torch
from torch import Tensor, nn


class PackedBatch(TypedDict):
    """One packed row; T = token_budget, D = max_documents. Documents from index 0, padding at the end."""

    input_ids: Tensor  # int64 [T], pad id on padding
    position_ids: Tensor  # int64 [T], 0.. restarting at every document; the padding tail is its own run
    doc_ids: Tensor  # int32 [T], 0..n_docs-1 in order, -1 on padding
    loss_mask: Tensor  # bool [T], True on supervised (assistant) tokens
    doc_lengths: Tensor  # int32 [D], document lengths, zero-padded


def collate_documents(
    docs: Sequence[tuple[Sequence[int] | Tensor, Sequence[bool] | Tensor]],
    token_budget: int,
    max_documents: int,
    pad_id: int,
) -> PackedBatch:
    """Lays `(input_ids, loss_mask)` documents out contiguously in one fixed-shape row of `token_budget`."""
    if len(docs) > max_documents:
        raise ValueError(f"{len(docs)} documents do not fit max_documents={max_documents}")
    lengths = [len(ids) for ids, _ in docs]
    if sum(lengths) > token_budget:
        raise ValueError(f"documents of {sum(lengths)} tokens do not fit token_budget={token_budget}")
    input_ids = torch.full((token_budget,), pad_id, dtype=torch.int64)
    position_ids = torch.empty(token_budget, dtype=torch.int64)
    doc_ids = torch.full((token_budget,), -1, dtype=torch.int32)
    loss_mask = torch.zeros(token_budget, dtype=torch.bool)
    doc_lengths = torch.zeros(max_documents, dtype=torch.int32)
    start = 0
    for d, ((ids, mask), n) in enumerate(zip(docs, lengths, strict=True)):
        if n == 0 or len(mask) != n:
            raise ValueError(f"document {d}: {n} tokens with a loss mask of {len(mask)}; need n > 0 and equal")
        end = start + n
        input_ids[start:end] = torch.as_tensor(ids)
        loss_mask[start:end] = torch.as_tensor(mask, dtype=torch.bool)
        position_ids[start:end] = torch.arange(n)
        doc_ids[start:end] = d
        doc_lengths[d] = n
        start = end
    position_ids[start:] = torch.arange(token_budget - start)
    return PackedBatch(
        input_ids=input_ids, position_ids=position_ids, doc_ids=doc_ids, loss_mask=loss_mask, doc_lengths=doc_lengths
    )


def best_fit_decreasing(
    lengths: Sequence[int], indices: Sequence[int], token_budget: int, max_documents: int
) -> list[list[int]]:
    """Puts documents `indices`, longest first, each into the open row it fills best; returns rows of indices."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # sorted (free tokens, row) of rows that can take one more document
    for i in sorted(indices, key=lambda i: -lengths[i]):  # stable sort: ties keep the buffer's (shuffled) order
        n = lengths[i]
        if n > token_budget:
            raise ValueError(
                f"document {i} has {n} tokens > token_budget {token_budget}; max_length must be <= token_budget"
            )
        k = bisect_left(open_rows, (n, -1))  # first row with at least n free tokens, i.e. the best fit
        if k < len(open_rows):
            free, r = open_rows.pop(k)
        else:
            free, r = token_budget, len(rows)
            rows.append([])
        rows[r].append(i)
        free -= n
        if free > 0 and len(rows[r]) < max_documents:
            insort(open_rows, (free, r))
    return rows


def pack_documents(
    lengths: Sequence[int], token_budget: int, max_documents: int, buffer_size: int, seed: int | str | None
) -> list[list[int]]:
    """Packs every document once, best-fit-decreasing within consecutive buffers of `buffer_size` documents.

    With a seed the documents are shuffled first and the rows after; with None the file order is kept.
    """
    order = list(range(len(lengths)))
    rng = None if seed is None else random.Random(seed)
    if rng is not None:
        rng.shuffle(order)
    rows: list[list[int]] = []
    for start in range(0, len(order), buffer_size):
        rows.extend(best_fit_decreasing(lengths, order[start : start + buffer_size], token_budget, max_documents))
    if rng is not None:
        rng.shuffle(rows)  # best-fit-decreasing emits each buffer's longest documents first
    return rows


def padding_fraction(num_rows: int, num_tokens: int, token_budget: int) -> float:
    """Fraction of the `num_rows * token_budget` packed slots that hold padding."""
    return 1.0 - num_tokens / (num_rows * token_budget) if num_rows else 0.0


def shard_rows(rows: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """This process's share of the rows; the list is first padded by repeating its head so all shares are equal."""
    if world_size == 1:
        return rows
    padded = rows + rows[: -len(rows) % world_size]  # every process must run the same number of steps
    return padded[rank::world_size]


def split_rows(rows: list[list[int]], target: int) -> list[list[int]]:
    """Splits the last document off multi-document rows, first rows first, until there are `target` rows."""
    rows = list(rows)
    while len(rows) < target:
        splittable = [k for k, row in enumerate(rows) if len(row) > 1][: target - len(rows)]
        if not splittable:
            raise ValueError(f"cannot split {sum(map(len, rows))} documents into {target} rows")
        for k in reversed(splittable):  # from the back, so that the indices in front stay valid
            rows[k : k + 1] = [rows[k][:-1], rows[k][-1:]]
    return rows


class EpochPacker:
    """Packs the training documents anew every epoch (seed + epoch) into exactly `rows_per_epoch` rows.

    Lightning fixes `len(dataloader)` when training starts and validates when that many batches were
    seen, so every epoch must have the same number of rows: epoch 0's count plus a little headroom,
    rounded up to a multiple of the number of processes. An epoch that packs into fewer rows splits a
    few rows; one that needs more is reshuffled (a few tries), else reuses epoch 0's rows in a new order.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        token_budget: int,
        max_documents: int,
        buffer_size: int,
        seed: int,
        multiple_of: int = 1,
        headroom: float = 0.002,
        tries: int = 8,
    ) -> None:
        self.lengths = list(lengths)
        self.token_budget = token_budget
        self.max_documents = max_documents
        self.buffer_size = buffer_size
        self.seed = seed
        self.tries = tries
        self.multiple_of = multiple_of
        self.first = self._pack(seed)
        target = len(self.first) + math.ceil(headroom * len(self.first))
        self.rows_per_epoch = min(len(self.lengths), math.ceil(target / multiple_of) * multiple_of)

    def _pack(self, seed: int | str) -> list[list[int]]:
        return pack_documents(self.lengths, self.token_budget, self.max_documents, self.buffer_size, seed)

    def rows(self, epoch: int) -> list[list[int]]:
        """The `rows_per_epoch` packed rows of `epoch`, deterministic for (seed, epoch)."""
        for attempt in range(self.tries):
            if epoch == 0 and attempt == 0:
                rows = self.first
            else:
                rows = self._pack(self.seed + epoch if attempt == 0 else f"{self.seed + epoch}/{attempt}")
            if len(rows) <= self.rows_per_epoch:
                return split_rows(rows, self.rows_per_epoch)
        rows = list(self.first)
        random.Random(f"{self.seed + epoch}/reuse").shuffle(rows)
        return split_rows(rows, self.rows_per_epoch)


BATCH_KEYS = ("input_ids", "position_ids", "doc_ids", "loss_mask")


class StepBuffers(nn.Module):
    """Persistent fixed-shape inputs of the training step (static addresses for CUDA graphs)."""

    def __init__(
        self, token_budget: int, feature_dim: int, slot_weights: Tensor, final_dim: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        t = token_budget
        self.register_buffer("input_ids", torch.zeros(t, dtype=torch.long), persistent=False)
        self.register_buffer("position_ids", torch.zeros(t, dtype=torch.long), persistent=False)
        self.register_buffer("doc_ids", torch.full((t,), -1, dtype=torch.int32), persistent=False)
        self.register_buffer("loss_mask", torch.zeros(t, dtype=torch.bool), persistent=False)
        self.register_buffer("features", torch.zeros(t, feature_dim, dtype=dtype), persistent=False)  # [T, K*H]
        self.register_buffer("slot_weights", slot_weights, persistent=False)  # [B]
        # The target's final normed hidden states, the teacher of distillation; absent for plain CE.
        final = torch.zeros(t, final_dim, dtype=dtype) if final_dim else None  # [T, H]
        self.register_buffer("final_hidden", final, persistent=False)

    def load(self, batch: dict[str, Tensor]) -> None:
        """Copy one packed batch in; a batch of another shape is refused with the field named."""
        keys = (*BATCH_KEYS, "features", *(("final_hidden",) if self.final_hidden is not None else ()))
        for key in keys:
            src = batch["context_features" if key == "features" else key]
            dst = getattr(self, key)
            if src.shape != dst.shape:
                raise ValueError(f"batch field '{key}' has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src, non_blocking=True)
