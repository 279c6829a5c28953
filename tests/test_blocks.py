"""Anchors, labels, slot weights and the block mask against plain references built from docs/method.md."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import packed_batch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from dflash_lightning.blocks import (
    BlockLayout,
    base_slot_weights,
    block_input_ids,
    block_labels,
    block_mask_mod,
    build_block_mask,
    dpace_weights,
    select_anchors,
    slot_weights,
    teacher_positions,
    tiled_block_mask,
)


def reference_mask(doc_ids: list[int], anchors: list[int], valid: list[bool], block: int,
                   window: int | None = None, causal: bool = False) -> torch.Tensor:
    """Dense [A*B, T + A*B] visibility, element by element, from the rules of sections 3 and 3b."""
    total, n_blocks = len(doc_ids), len(anchors)
    mask = torch.zeros(n_blocks * block, total + n_blocks * block, dtype=torch.bool)
    for a, p in enumerate(anchors):
        for k in range(block):
            q = a * block + k
            for j in range(total):  # context: same document, strictly before the anchor, inside the slot's window
                in_window = window is None or (p + k) - j < window
                mask[q, j] = valid[a] and doc_ids[j] == doc_ids[p] and j < p and in_window
            for k2 in range(block):  # own block: both directions, or slots 0..k when causal
                mask[q, total + a * block + k2] = (not causal or k2 <= k) and (window is None or abs(k - k2) < window)
    return mask


def tiles(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Dense `[query tiles, key tiles]` map of a BlockMask's listed tiles."""
    out = torch.zeros(indices.shape[-2:], dtype=torch.bool)
    for i, n in enumerate(num_blocks[0, 0].tolist()):
        out[i, indices[0, 0, i, :n].long()] = True
    return out


CASES = [
    ([20, 7, 30], 64, 12, 4),          # several documents plus padding
    ([5, 5, 5, 5], 24, 10, 8),         # anchors near document ends, more slots than candidates
    ([64], 64, 20, 16),                # one document filling the budget
    ([9, 25, 13], 52, 9, 10),          # B=10: blocks straddle tiles, T not a multiple of the tile
]
# (window, causal): full bidirectional; causal sliding windows (the reference's default for sliding layers),
# one narrower than the block; a bidirectional sliding window (config.json `is_causal: false`); causal full.
RULES = [(None, False), (7, True), (3, True), (5, False), (None, True)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"W{r[0]}-{'causal' if r[1] else 'bidir'}")
@pytest.mark.parametrize("docs,total,num_anchors,block", CASES)
def test_block_mask_matches_dense_reference(docs, total, num_anchors, block, rule):
    window, causal = rule
    batch = packed_batch(docs, total, seed=len(docs))
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], num_anchors, torch.Generator().manual_seed(1))
    mask_mod = block_mask_mod(batch["doc_ids"], anchors, valid, block, window, causal)
    q_len, kv_len = num_anchors * block, total + num_anchors * block
    dense = create_mask(mask_mod, None, None, q_len, kv_len, device="cpu")[0, 0]
    expected = reference_mask(batch["doc_ids"].tolist(), anchors.tolist(), valid.tolist(), block, window, causal)
    assert torch.equal(dense, expected)
    # The sparse BlockMask drives flex_attention to the same result as dense attention under that mask.
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (q_len, kv_len, kv_len))
    sparse = tiled_block_mask(batch["doc_ids"], anchors, valid, block, tile=16, window=window, causal=causal)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=expected)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=sparse), ref)
    # Its partial and full tiles are exactly those flex finds by evaluating the mask everywhere.
    evaluated = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=16)
    assert sparse.kv_indices.shape[-2:] == evaluated.kv_indices.shape[-2:]
    assert torch.equal(tiles(sparse.kv_num_blocks, sparse.kv_indices),
                       tiles(evaluated.kv_num_blocks, evaluated.kv_indices))
    assert torch.equal(tiles(sparse.full_kv_num_blocks, sparse.full_kv_indices),
                       tiles(evaluated.full_kv_num_blocks, evaluated.full_kv_indices))
    # On the CPU the step uses the same rule materialised densely.
    assert torch.equal(build_block_mask(batch["doc_ids"], anchors, valid, block, window, causal), expected)


@pytest.mark.parametrize("block,window", [(16, None), (10, None), (16, 300)])
def test_tiled_block_mask_at_training_tile_size(block, window):
    """The GPU tile of 128 over a realistic row: many documents, sorted anchors, padding at the end."""
    batch = packed_batch([300, 41, 517, 90, 700, 250], 2000, seed=5, supervise_from=30)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 100, torch.Generator().manual_seed(2))
    q_len, kv_len = 100 * block, 2000 + 100 * block
    causal = window is not None
    ours = tiled_block_mask(batch["doc_ids"], anchors, valid, block, window=window, causal=causal)
    mask_mod = block_mask_mod(batch["doc_ids"], anchors, valid, block, window, causal)
    evaluated = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=128)
    assert torch.equal(tiles(ours.kv_num_blocks, ours.kv_indices), tiles(evaluated.kv_num_blocks, evaluated.kv_indices))
    assert torch.equal(tiles(ours.full_kv_num_blocks, ours.full_kv_indices),
                       tiles(evaluated.full_kv_num_blocks, evaluated.full_kv_indices))
    assert ours.full_kv_num_blocks.sum() > 0  # the row has full tiles, so the skip of mask_mod is exercised
    if window is not None:  # the window hides tiles the full mask of the same row lists
        full = tiled_block_mask(batch["doc_ids"], anchors, valid, block)
        listed = (ours.kv_num_blocks + ours.full_kv_num_blocks).sum()
        assert listed < (full.kv_num_blocks + full.full_kv_num_blocks).sum()


def test_padding_sees_nothing_and_is_seen_by_nothing():
    batch = packed_batch([10, 6], 32)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 8)
    dense = create_mask(block_mask_mod(batch["doc_ids"], anchors, valid, 4), None, None, 32, 64, device="cpu")[0, 0]
    assert not dense[:, 16:32].any()  # padding context keys
    assert (batch["doc_ids"][anchors[valid]] >= 0).all()  # no block is anchored on padding


def test_anchors_valid_positions_fixed_shape_and_uniform():
    batch = packed_batch([12, 9, 3], 40, supervise_from=4)
    mask, doc = batch["loss_mask"], batch["doc_ids"]
    candidates = {p for p in range(39) if mask[p] and mask[p + 1] and doc[p] == doc[p + 1] and doc[p] >= 0}
    counts = torch.zeros(40)
    for seed in range(400):
        anchors, valid = select_anchors(mask, doc, 16, torch.Generator().manual_seed(seed))
        assert anchors.shape == (16,) and valid.shape == (16,)
        chosen = anchors[valid].tolist()
        assert set(chosen) <= candidates and len(set(chosen)) == len(chosen) == min(16, len(candidates))
        assert chosen == sorted(chosen) and not valid[len(chosen):].any()  # valid first, sorted
        counts[chosen] += 1
    # 16 slots >= candidates here, so every candidate is always chosen.
    assert all(counts[p] == 400 for p in candidates)
    few = [select_anchors(mask, doc, 3, torch.Generator().manual_seed(s))[0] for s in range(600)]
    freq = torch.bincount(torch.cat(few), minlength=40)[sorted(candidates)].float() / 600
    torch.testing.assert_close(freq, torch.full_like(freq, 3 / len(candidates)), atol=0.08, rtol=0)


def test_slot_weights():
    w = slot_weights(16, 7.0)
    assert w[0] == 0
    for k in range(1, 16):
        assert math.isclose(w[k].item(), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


def test_block_inputs_labels_and_weights():
    batch = packed_batch([6, 5], 16, supervise_from=1)
    ids, mask, doc = batch["input_ids"], batch["loss_mask"], batch["doc_ids"]
    anchors = torch.tensor([1, 4, 7, 0])
    valid = torch.tensor([True, True, True, False])
    w_slot = slot_weights(4, 4.0)
    labels, weights = block_labels(ids, mask, doc, anchors, valid, w_slot)
    blocks = block_input_ids(ids, anchors, 4, mask_token_id=99)
    for a, p in enumerate(anchors.tolist()):
        assert blocks[a, 0] == ids[p] and (blocks[a, 1:] == 99).all()
        for k in range(4):
            j = p + k
            ok = valid[a] and k > 0 and j < 16 and doc[j] == doc[p] and mask[j]
            assert weights[a, k] == (w_slot[k] if ok else 0), (a, k)
            if ok:
                assert labels[a, k] == ids[j]
    assert weights[1, 2:].eq(0).all()  # anchor 4 of the 6-token document: slots past its end are 0


def reference_dpace(ce: list[list[float]], supervised: list[list[bool]], alpha: float) -> list[list[float]]:
    """docs/method.md section 4b slot by slot: w_k = m_k * sum_{j >= k} m_j * prod_{i=1..j} s_i."""
    out = []
    for ce_row, m in zip(ce, supervised, strict=True):
        s = [(1 - alpha) * math.exp(-c) + alpha if m[i] else 1.0 for i, c in enumerate(ce_row)]
        row = []
        for k in range(len(ce_row)):
            total = 0.0
            for j in range(k, len(ce_row)):
                prod = 1.0
                for i in range(1, j + 1):
                    prod *= s[i]
                total += m[j] * prod
            row.append(m[k] * total)
        out.append(row)
    return out


@pytest.mark.pinned_only("reference")
@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0])
def test_dpace_weights_match_a_plain_loop_over_slots(alpha):
    g = torch.Generator().manual_seed(0)
    ce = torch.rand(5, 8, generator=g, dtype=torch.float64) * 4
    supervised = torch.ones(5, 8, dtype=torch.bool)
    supervised[:, 0] = False  # slot 0 predicts nothing
    supervised[1, 5:] = False  # past the document's end
    supervised[2, 3] = False  # a label outside the loss mask mid-block
    supervised[3] = False  # an invalid anchor
    w = dpace_weights(ce, supervised, alpha)
    ref = torch.tensor(reference_dpace(ce.tolist(), supervised.tolist(), alpha), dtype=torch.float32)
    torch.testing.assert_close(w, ref)
    assert (w[~supervised] == 0).all() and (w[supervised] > 0).all()
    if alpha == 1.0:  # no dependence on the CE: w_k counts the supervised slots from k on
        assert w[0].tolist() == [0, 7, 6, 5, 4, 3, 2, 1]


def test_teacher_positions_are_the_token_before_each_slot():
    anchors = torch.tensor([0, 5, 9])
    pos = teacher_positions(anchors, 4, 11)
    assert pos.tolist() == [[0, 0, 1, 2], [4, 5, 6, 7], [8, 9, 10, 10]]


@pytest.mark.parametrize("layout", [BlockLayout(), BlockLayout(anchor_first=True, gamma=4.0),
                                    BlockLayout(anchor_first=True, last_slot_drafts=False, gamma=7.0)],
                         ids=["fill-in", "anchor-first", "anchor-first-last-undrafted"])
def test_block_layouts_against_their_tables(layout):
    """Sections 3/4, 12 and 13 as docs/parts.md tabulates them: which slots predict, draft and weigh what."""
    for block in (2, 3, 8, 16):
        predicting = [k for k in range(block) if layout.anchor_first or k >= 1]
        drafting = predicting[:-1] if not layout.last_slot_drafts else predicting
        assert list(range(block))[layout.draft_slots(block)] == drafting and layout.drafts(block) == len(drafting)
        gamma = layout.default_gamma(block)
        assert gamma == (layout.gamma or {16: 7.0, 8: 4.0}.get(block))
        if gamma is None:
            continue
        shift = 0 if layout.anchor_first else 1
        expected = [math.exp(-(k - shift) / gamma) if k in predicting else 0.0 for k in range(block)]
        assert slot_weights(block, gamma, layout=layout).tolist() == pytest.approx(expected)
        assert base_slot_weights(block, "dpace", gamma, layout).tolist() == [float(k in predicting)
                                                                             for k in range(block)]
    offset = 1 if layout.anchor_first else 0  # slot k predicts p + k + offset; its teacher row is the one before
    assert teacher_positions(torch.tensor([3, 10]), 4, 100, layout).tolist() == [
        [p + k + offset - 1 for k in range(4)] for p in (3, 10)]
