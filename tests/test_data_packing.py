"""Packing: the fixed-shape row layout, best-fit-decreasing against a plain reference, epochs and shards."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_lightning.data.packing import (
    EpochPacker,
    best_fit_decreasing,
    collate_documents,
    pack_documents,
    padding_fraction,
    shard_rows,
    split_rows,
)


def reference_bfd(lengths: list[int], indices: list[int], budget: int, max_docs: int) -> list[list[int]]:
    """Obviously correct O(n^2) best-fit-decreasing: the fullest row that still fits, lowest index on ties."""
    rows: list[list[int]] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        fits = [r for r, row in enumerate(rows)
                if len(row) < max_docs and budget - sum(lengths[j] for j in row) >= lengths[i]]
        if fits:
            best = min(fits, key=lambda r: (budget - sum(lengths[j] for j in rows[r]), r))
            rows[best].append(i)
        else:
            rows.append([i])
    return rows


def random_lengths(n: int, low: int = 8, high: int = 100, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def test_collate_layout():
    docs = [([5, 6, 7], [False, True, True]), (torch.tensor([8, 9]), torch.tensor([True, False]))]
    b = collate_documents(docs, token_budget=8, max_documents=4, pad_id=1)
    assert {k: (tuple(v.shape), v.dtype) for k, v in b.items()} == {
        "input_ids": ((8,), torch.int64), "position_ids": ((8,), torch.int64), "doc_ids": ((8,), torch.int32),
        "loss_mask": ((8,), torch.bool), "doc_lengths": ((4,), torch.int32),
    }
    assert b["input_ids"].tolist() == [5, 6, 7, 8, 9, 1, 1, 1]
    assert b["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert b["doc_ids"].tolist() == [0, 0, 0, 1, 1, -1, -1, -1]
    assert b["loss_mask"].tolist() == [False, True, True, True, False, False, False, False]
    assert b["doc_lengths"].tolist() == [3, 2, 0, 0]
    full = collate_documents([([1] * 8, [True] * 8)], 8, 1, 0)
    assert full["doc_ids"].tolist() == [0] * 8 and full["position_ids"].tolist() == list(range(8))


def test_collate_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="token_budget=4"):
        collate_documents([([1, 2, 3], [True] * 3), ([4, 5], [True] * 2)], 4, 4, 0)
    with pytest.raises(ValueError, match="max_documents=1"):
        collate_documents([([1], [True]), ([2], [True])], 4, 1, 0)
    with pytest.raises(ValueError, match="loss mask"):
        collate_documents([([1, 2], [True])], 4, 1, 0)


@pytest.mark.pinned_only("reference")
@pytest.mark.parametrize("max_docs", [2, 3, 64])
def test_bfd_matches_reference(max_docs):
    lengths = random_lengths(300, seed=max_docs)
    idx = list(range(300))
    random.Random(1).shuffle(idx)
    rows = best_fit_decreasing(lengths, idx, 256, max_docs)
    assert rows == reference_bfd(lengths, idx, 256, max_docs)
    assert sorted(i for row in rows for i in row) == list(range(300))
    assert all(sum(lengths[i] for i in row) <= 256 and len(row) <= max_docs for row in rows)


def test_bfd_refuses_a_document_longer_than_the_budget():
    with pytest.raises(ValueError, match="max_length must be <= token_budget"):
        best_fit_decreasing([10, 300], [0, 1], 256, 4)


def test_pack_documents_seeded_and_file_order():
    lengths = random_lengths(1000)
    a = pack_documents(lengths, 512, 8, 128, seed=3)
    assert a == pack_documents(lengths, 512, 8, 128, seed=3)
    assert a != pack_documents(lengths, 512, 8, 128, seed=4)
    assert sorted(i for row in a for i in row) == list(range(1000))
    ordered = pack_documents(lengths, 512, 8, 128, seed=None)
    # without a seed each buffer of 128 documents fills rows of its own, buffers in file order
    buffers = [{i // 128 for i in row} for row in ordered]
    assert all(len(b) == 1 for b in buffers) and buffers == sorted(buffers, key=min)
    # best-fit-decreasing packs densely when the document cap does not bind: at most one extra row per buffer
    dense = pack_documents(lengths, 512, 64, 128, seed=3)
    assert len(dense) <= -(-sum(lengths) // 512) + 8
    assert padding_fraction(len(dense), sum(lengths), 512) < 0.05


def test_max_documents_respected():
    lengths = [4] * 100
    rows = pack_documents(lengths, 256, 3, 1024, seed=0)
    assert sorted(len(row) for row in rows) == [1] + [3] * 33


def test_epoch_packer_fixed_length_and_reshuffle():
    lengths = random_lengths(2000, seed=5)
    packer = EpochPacker(lengths, 512, 16, 256, seed=7)
    epochs = [packer.rows(e) for e in range(6)]
    target = packer.rows_per_epoch
    assert epochs[0] == split_rows(pack_documents(lengths, 512, 16, 256, seed=7), target)
    assert epochs[1] == split_rows(pack_documents(lengths, 512, 16, 256, seed=8), target)  # seed + epoch
    assert EpochPacker(lengths, 512, 16, 256, seed=7, multiple_of=8).rows_per_epoch % 8 == 0
    for rows in epochs:
        assert len(rows) == packer.rows_per_epoch  # Lightning's len(dataloader) holds for every epoch
        assert sorted(i for row in rows for i in row) == list(range(2000))
    assert len({str(rows) for rows in epochs}) == 6


def test_split_rows():
    assert split_rows([[0, 1, 2], [3], [4, 5]], 5) == [[0, 1], [2], [3], [4], [5]]
    assert split_rows([[0, 1, 2], [3]], 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="cannot split 2 documents into 3 rows"):
        split_rows([[0, 1]], 3)


def test_epoch_packer_falls_back_to_reordered_reference():
    lengths = random_lengths(500, seed=2)
    packer = EpochPacker(lengths, 512, 16, 64, seed=0, headroom=0.0, tries=0)
    rows = packer.rows(3)
    assert rows != packer.first and sorted(rows) == sorted(packer.first)
    assert rows == EpochPacker(lengths, 512, 16, 64, seed=0, headroom=0.0, tries=0).rows(3)


def test_shard_rows():
    rows = [[i] for i in range(7)]
    shards = [shard_rows(rows, r, 3) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    assert sorted(i for s in shards for row in s for i in row) == [0, 0, 1, 1, 2, 3, 4, 5, 6]
    assert shard_rows(rows, 0, 1) is rows
