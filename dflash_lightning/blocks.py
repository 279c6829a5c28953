"""The block rules of docs/method.md sections 3-4b, 12 and 13: the block layout, anchors, block inputs, labels, slot
weights, block mask.

One implementation of each rule, used by training, evaluation and export; every tensor has a fixed
shape set by the token budget T, the anchor count A and the block size B, so the step compiles once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
"""Section 4's slot-weight decay gamma per block size; a layout without its own default takes it from here."""


@dataclass(frozen=True)
class BlockLayout:
    """What the slots of a block `[x_p, MASK x (B-1)]` at positions p..p+B-1 do: which position each predicts,
    which are trained, which are drafted, and the default decay of their loss weights.

    A preset's layout is derived from its parts (`Part.layout`, `Preset.layout`) and read here and through
    `DrafterConfig.layout` alone: training, metrics, decoding and export never ask which variant they have.
    """

    anchor_first: bool = False
    """False: slot k predicts position p + k and slot 0, the given anchor, nothing (section 3's fill-in block); true:
    every slot k = 0..B-1 predicts p + k + 1 (section 12's anchor-first block), and a slot is supervised only while
    every slot before it is (DeepSpec's running product m_k, sections 12 and 13)."""
    last_slot_drafts: bool = True
    """Whether slot B-1's prediction is drafted. False (Domino, section 13): an anchor-first block trains all B slots
    but drafts slots 0..B-2, B-1 tokens verified as a fill-in block's are."""
    gamma: float | None = None
    """Default gamma of the slot weights `exp(-(k - first_slot) / gamma)`; None: section 4's per-block-size table
    (`DEFAULT_GAMMA`). DSpark 4 (`exp(-k/4)`), Domino 7."""

    @property
    def first_slot(self) -> int:
        """The first slot that predicts a token, the first trained and the first drafted: 1, anchor-first 0."""
        return 0 if self.anchor_first else 1

    @property
    def label_offset(self) -> int:
        """Slot k predicts position p + k + `label_offset`."""
        return 1 if self.anchor_first else 0

    def drafts(self, block_size: int) -> int:
        """Tokens drafted per block: B - 1 (fill-in, or anchor-first without its last slot), B (DSpark)."""
        return block_size - self.first_slot - (0 if self.last_slot_drafts else 1)

    def draft_slots(self, block_size: int) -> slice:
        """The slots whose predictions are the block's drafts, in order: 1..B-1, 0..B-1 or 0..B-2."""
        return slice(self.first_slot, self.first_slot + self.drafts(block_size))

    def default_gamma(self, block_size: int) -> float | None:
        """The slot weights' gamma where `model.drafter.gamma` is unset; None: no default for this block size."""
        return self.gamma if self.gamma is not None else DEFAULT_GAMMA.get(block_size)


FILL_IN = BlockLayout()
"""Section 3's block: slot k predicts p + k, slots 1..B-1 trained and drafted, section 4's gamma."""


def slot_weights(
    block_size: int, gamma: float, device: torch.device | str | None = None, layout: BlockLayout = FILL_IN,
) -> Tensor:
    """Loss weight of each slot: exp(-(k - first) / gamma) for the slots k >= first that predict (first = 1: slot 0
    weighs 0; anchor-first first = 0, section 12: exp(-k / gamma)).  # [B]"""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    first = layout.first_slot
    return torch.where(k < first, torch.zeros_like(k), torch.exp(-(k - first) / gamma))


def base_slot_weights(block_size: int, loss_weights: str, gamma: float, layout: BlockLayout = FILL_IN) -> Tensor:
    """Per-slot weights before the data: the decay of section 4 (12: anchor-first), or 1 for every slot that
    predicts under D-PACE.  # [B]

    Under D-PACE the weights follow from each step's CE inside the loss (`dpace_weights`); here they
    only mark which slots count.
    """
    if loss_weights == "dpace":
        return (torch.arange(block_size) >= layout.first_slot).float()
    return slot_weights(block_size, gamma, layout=layout)


def dpace_weights(ce: Tensor, supervised: Tensor, alpha: float = 0.5) -> Tensor:
    """D-PACE slot weights of blocks (docs/method.md section 4b) from their per-slot CE `[..., B]`.  # [..., B]

    `w_k = m_k * sum_{j>=k} m_j * prod_{i<=j} s_i` with `s_i = (1 - alpha) * exp(-CE_i) + alpha` where slot i
    is supervised (`m_i`), else 1: the derivative of the expected accepted length by `log s_k`. No gradient.
    """
    ce = ce.detach().float()
    s = torch.where(supervised, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
    reach = torch.cumprod(s, dim=-1) * supervised  # m_j * prod_{i<=j} s_i (slot 0 is never supervised)
    suffix = reach.flip(-1).cumsum(-1).flip(-1)  # sum over j >= k
    return suffix * supervised


def anchor_candidates(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """Positions p where p and p+1 are both supervised and in the same document.  # [T] bool"""
    nxt_same_doc = (doc_ids[:-1] == doc_ids[1:]) & (doc_ids[:-1] >= 0)
    ok = loss_mask[:-1] & loss_mask[1:] & nxt_same_doc
    return torch.cat([ok, ok.new_zeros(1)])


def anchor_seed(seed: int, split: str, epoch: int, index: int) -> int:
    """Seed of one batch's anchor draw, a function of the batch's place in the data stream only.

    No generator state to save: a resumed run, on any number of ranks, draws the same anchors for the
    same batch (`index` is the batch's position in its epoch's global stream).
    """
    key = f"{seed}/{split}/{epoch}/{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # < 2**63


def select_anchors(
    loss_mask: Tensor, doc_ids: Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Sample `num_anchors` candidates uniformly without replacement, in a fixed shape.

    Returns anchors `[A]` sorted by position (unused slots last) and their validity `[A]`; random
    scores plus `topk` replace `nonzero`/`randperm`, whose output sizes depend on the data.
    """
    candidates = anchor_candidates(loss_mask, doc_ids)  # [T]
    scores = torch.rand(candidates.shape, generator=generator, device=candidates.device)
    scores = torch.where(candidates, scores, -1.0)
    top, idx = torch.topk(scores, num_anchors)  # [A]
    valid = top >= 0
    # Sorting keeps neighbouring query tiles on neighbouring contexts, so the block mask stays sparse.
    order = torch.argsort(torch.where(valid, idx, idx + candidates.numel()))
    return idx[order], valid[order]


def block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """Packed-sequence index of every slot: anchor + k.  # [A, B]"""
    return anchors[:, None] + torch.arange(block_size, device=anchors.device)


def label_positions(anchors: Tensor, block_size: int, layout: BlockLayout = FILL_IN) -> Tensor:
    """Packed index of the token each slot predicts: anchor + k (section 3), anchor + k + 1 anchor-first
    (section 12).  # [A, B]"""
    return block_positions(anchors, block_size) + layout.label_offset


def teacher_positions(anchors: Tensor, block_size: int, total: int, layout: BlockLayout = FILL_IN) -> Tensor:
    """Packed index of the target hidden state that predicts each slot's label: the label's position - 1 (section
    4c; anchor-first: anchor + k).  # [A, B]

    Slots that predict nothing and slots past the budget are clamped into the row; their weight is 0.
    """
    return (label_positions(anchors, block_size, layout) - 1).clamp(0, total - 1)


def block_input_ids(input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """Block tokens `[token_p, MASK, ..., MASK]` for every anchor.  # [A, B]"""
    ids = torch.full((anchors.numel(), block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, 0] = input_ids[anchors]
    return ids


def block_labels(
    input_ids: Tensor,
    loss_mask: Tensor,
    doc_ids: Tensor,
    anchors: Tensor,
    anchor_valid: Tensor,
    weights_per_slot: Tensor,
    layout: BlockLayout = FILL_IN,
) -> tuple[Tensor, Tensor]:
    """Labels `[A, B]` (the data token at `label_positions`) and their loss weights `[A, B]`.

    A weight is 0 for slot 0 (section 3's block), for labels outside the loss mask, past the document or the
    budget, and for invalid anchors; otherwise it is the slot's weight. Anchor-first (sections 12, 13) a slot
    counts only where every slot before it does too (DeepSpec's running product m_k).
    """
    total = input_ids.numel()
    pos = label_positions(anchors, weights_per_slot.numel(), layout)  # [A, B]
    inside = pos < total
    pos = pos.clamp(max=total - 1)
    supervised = inside & loss_mask[pos] & (doc_ids[pos] == doc_ids[anchors][:, None]) & anchor_valid[:, None]
    if layout.anchor_first:
        supervised = supervised.int().cumprod(-1).bool()
    return input_ids[pos], weights_per_slot[None, :] * supervised


def window_rule(
    query_pos: Tensor, key_pos: Tensor, key_in_block: Tensor, window: int | None, causal: bool
) -> Tensor | bool:
    """A layer's rule of docs/method.md section 3b on keys its block may see: causal inside the block, a window.

    The query at position `p + i` keeps a context key at j when `(p + i) - j < W`; a key of its own block
    at `p + k` when `k <= i` (causal) and `|i - k| < W`. Full bidirectional layers keep everything.
    """
    keep: Tensor | bool = True
    if causal:
        keep = keep & (~key_in_block | (key_pos <= query_pos))
    if window is not None:
        keep = keep & (query_pos - key_pos < window)
        if not causal:
            keep = keep & (~key_in_block | (key_pos - query_pos < window))
    return keep


def block_mask_mod(
    doc_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int, window: int | None = None,
    causal: bool = False,
):
    """flex_attention mask over keys `[context (T); blocks (A*B)]` for queries `[blocks (A*B)]`.

    A block sees its document's context strictly before its anchor and its own B tokens (both ways unless
    `causal`), within `window` of each slot (`window_rule`); never another block, another document, or padding.
    """
    context_len = doc_ids.numel()
    anchor_doc = doc_ids[anchors]  # [A]

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = q_idx // block_size
        is_context = kv_idx < context_len
        ctx = kv_idx.clamp(max=context_len - 1)
        sees_context = (
            is_context & anchor_valid[block] & (doc_ids[ctx] == anchor_doc[block]) & (ctx < anchors[block])
        )
        sees_block = ~is_context & ((kv_idx - context_len) // block_size == block)
        visible = sees_context | sees_block
        if window is None and not causal:
            return visible
        # Inside a document packed indices are positions plus the document's start: differences are equal.
        query_pos = anchors[block] + q_idx % block_size
        key_pos = torch.where(is_context, ctx, anchors[block] + (kv_idx - context_len) % block_size)
        return visible & window_rule(query_pos, key_pos, ~is_context, window, causal)

    return mask_mod


def build_block_mask(
    doc_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int, window: int | None = None,
    causal: bool = False, tile: int = 128,
) -> BlockMask | Tensor:
    """The mask of `block_mask_mod` for one packed batch: a BlockMask, or a dense `[A*B, T+A*B]` on CPU.

    flex_attention has no backward on the CPU, so there the same mask_mod is materialised for SDPA.
    """
    if doc_ids.device.type == "cpu":
        mask_mod = block_mask_mod(doc_ids, anchors, anchor_valid, block_size, window, causal)
        queries = anchors.numel() * block_size
        return create_mask(mask_mod, None, None, queries, doc_ids.numel() + queries, device="cpu")[0, 0]
    return tiled_block_mask(doc_ids, anchors, anchor_valid, block_size, tile, window, causal)


def tiled_block_mask(
    doc_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int, tile: int = 128,
    window: int | None = None, causal: bool = False,
) -> BlockMask:
    """The BlockMask of `block_mask_mod`, its tiles found from each slot's visible key ranges.

    Slot i of anchor p sees the keys `[max(start of its document, p + i - W + 1), p)` and a range of its own
    block's B keys, so which tiles hold visible keys follows from interval overlaps, without evaluating the
    mask over all `A*B x (T+A*B)` pairs (`create_block_mask` compiles that for minutes); tiles the window
    hides are skipped. Fixed shapes, no host sync; inside partial tiles `block_mask_mod` decides. Documents
    must be contiguous, as packing makes them.
    """
    T, A, B = doc_ids.numel(), anchors.numel(), block_size
    device = doc_ids.device
    position = torch.arange(T, device=device)
    new_doc = torch.ones(T, dtype=torch.bool, device=device)
    new_doc[1:] = doc_ids[1:] != doc_ids[:-1]
    doc_start = torch.cummax(torch.where(new_doc, position, 0), 0).values  # [T]
    slot = torch.arange(B, device=device)
    query_pos = (anchors[:, None] + slot).flatten()  # [A*B]
    anchor = anchors.repeat_interleave(B)  # [A*B]
    ctx_lo = doc_start[anchors].repeat_interleave(B)
    if window is not None:
        ctx_lo = torch.maximum(ctx_lo, query_pos - window + 1)
    ctx_hi = torch.where(anchor_valid.repeat_interleave(B), anchor, ctx_lo)  # an invalid anchor sees no context
    # Own-block keys of slot i, as slots [lo, hi): the same window_rule, as an interval.
    i = slot.repeat(A)
    blk_lo = i - window + 1 if window is not None else torch.zeros_like(i)
    blk_hi = i + 1 if causal else (i + window if window is not None else torch.full_like(i, B))
    blk_base = T + torch.arange(A, device=device).repeat_interleave(B) * B
    blk_lo, blk_hi = blk_base + blk_lo.clamp(0, B), blk_base + blk_hi.clamp(0, B)
    return interval_block_mask(
        [(ctx_lo, ctx_hi), (blk_lo, blk_hi)], T + A * B, tile,
        block_mask_mod(doc_ids, anchors, anchor_valid, block_size, window, causal),
    )


def interval_block_mask(intervals: list[tuple[Tensor, Tensor]], keys: int, tile: int, mask_mod) -> BlockMask:
    """The BlockMask of a mask whose visible keys of each query are disjoint ranges `[lo, hi)` (each `[Q]`).

    A tile is full when every query row of it sees all its keys, partial when some see some; the rest are
    skipped. Fixed shapes, no host sync; the tiles equal `create_block_mask`'s of the same `mask_mod`.
    """
    queries = intervals[0][0].numel()
    tile_lo = torch.arange(0, keys, tile, dtype=torch.int32, device=intervals[0][0].device)  # [Kt]
    tile_hi = (tile_lo + tile).clamp(max=keys)
    seen = sum(  # keys of each query's ranges in each key tile (int32: [Q, Kt] is 16M at a 32K budget)  # [Q, Kt]
        (torch.minimum(hi.int()[:, None], tile_hi) - torch.maximum(lo.int()[:, None], tile_lo)).clamp(min=0)
        for lo, hi in intervals
    )
    q_tiles = -(-queries // tile)
    pad = q_tiles * tile - queries  # rows past the queries count as seeing nothing, as in create_block_mask
    rows_any = F.pad(seen > 0, (0, 0, 0, pad)).unflatten(0, (q_tiles, tile))
    rows_full = F.pad(seen == tile, (0, 0, 0, pad)).unflatten(0, (q_tiles, tile))
    full = rows_full.all(1)  # [Qt, Kt]
    partial = rows_any.any(1) & ~full

    def as_kv_blocks(tiles: Tensor) -> tuple[Tensor, Tensor]:
        count = tiles.sum(-1, dtype=torch.int32)[None, None]
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None, None]
        return count, order

    return BlockMask.from_kv_blocks(
        *as_kv_blocks(partial), *as_kv_blocks(full), BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(queries, keys),
    )
