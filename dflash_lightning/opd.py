"""Draft-OPD (docs/opd.md, docs/method.md section 15): on-policy refinement of a trained drafter.

At each anchor the drafter drafts its block by its drafting rule; the target, replayed on the draft's own tokens,
gives every slot's distribution; greedy verification's accept mask splits the slots into the acceptance-aware loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask
from torch.utils.checkpoint import checkpoint

from dflash_lightning.blocks import FILL_IN, BlockLayout, interval_block_mask
from dflash_lightning.errors import ConfigError
from dflash_lightning.target_model.features import FeatureExtractor, packed_documents

EPS = 1e-5
"""The floor of L_acc's and L_rej's denominators (speculators' `_EPS`): a block set with no accepted (or no rejected)
slot gives that term 0."""


@dataclass
class OPDSettings:
    """The Draft-OPD stage's settings (`model.stage=opd`)."""

    gamma: float = 0.8
    """Decay of the rejected slots' reverse KL: slot k (0-based in its block) weighs gamma**k."""
    lambda_acc: float = 1.0
    """Weight of L_acc, the mean forward KL(p_target || q_draft) over accepted slots."""
    lambda_rej: float = 1.0
    """Weight of L_rej, the gamma-weighted mean reverse KL(q_draft || p_target) over rejected slots."""
    replay: bool = True
    """True: every slot's target distribution is conditioned on the draft's own tokens (one target forward of the
    row and all its draft blocks); false: taken from the row's own continuation (the target's final hidden states of
    the data, no extra forward), exact up to a block's first rejection and approximate after it."""
    sft_weight: float = 0.0
    """Weight of the supervised loss kept beside the stage's: L = L_OPD + sft_weight * L_SFT, L_SFT the supervised
    stage's objective (`model.objective`, `model.loss_weights`) on the same blocks; 0, the paper's loss."""

    def check(self) -> None:
        """Refuse values outside their range, naming the field."""
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"model.opd.gamma must be in (0, 1], got {self.gamma}")
        for name in ("lambda_acc", "lambda_rej", "sft_weight"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ConfigError(f"model.opd.{name} must be a finite number >= 0, got {value}")
        if self.lambda_acc + self.lambda_rej <= 0:
            raise ConfigError("model.opd.lambda_acc + model.opd.lambda_rej must be > 0, got 0")


def accept_mask(draft_ids: Tensor, target_ids: Tensor, layout: BlockLayout = FILL_IN) -> Tensor:
    """Greedy verification of blocks `[A, B]`: slot k is accepted while every draft up to it equals the target's
    argmax (a running product); a fill-in block's anchor slot is given, so it matches.  # [A, B] bool"""
    match = draft_ids == target_ids
    if not layout.anchor_first:
        match[:, 0] = True
    return match.int().cumprod(-1).bool()


def opd_loss(
    forward_kl: Tensor, reverse_kl: Tensor, accepted: Tensor, supervised: Tensor, settings: OPDSettings,
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = (lambda_acc L_acc + lambda_rej L_rej) / (lambda_acc + lambda_rej) over blocks `[A, B]`, and its logs.

    L_acc = mean of KL(p || q) over accepted supervised slots; L_rej = sum of gamma**k KL(q || p) over rejected
    supervised slots / sum of gamma**k, k the slot's index in its block (speculators' `opd_loss` of one sequence).
    """
    acc = (accepted & supervised).to(forward_kl.dtype)
    rej = (~accepted & supervised).to(forward_kl.dtype)
    decay = settings.gamma ** torch.arange(acc.shape[-1], device=acc.device, dtype=acc.dtype)  # [B]
    l_acc = (forward_kl * acc).sum() / acc.sum().clamp_min(EPS)
    l_rej = (reverse_kl * rej * decay).sum() / (rej * decay).sum().clamp_min(EPS)
    la, lr = settings.lambda_acc, settings.lambda_rej
    loss = (la * l_acc + lr * l_rej) / (la + lr)
    logs = {"opd/l_acc": l_acc.detach(), "opd/l_rej": l_rej.detach(), "opd/accepted_slots": acc.sum(),
            "opd/rejected_slots": rej.sum()}
    return loss, logs


def slot_kls(draft_hidden: Tensor, target_hidden: Tensor, head: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """KL(p || q), KL(q || p) and the target's argmax of rows `[N, H]`, q the draft's softmax and p the target's
    through the same frozen `head [V, H]`.  # [N], [N], [N]

    Made `chunk` rows at a time, each chunk recomputed in the backward: no `[N, V]` tensor is kept.
    """
    out = [checkpoint(_chunk_kls, d, t, head, use_reentrant=False)
           for d, t in zip(draft_hidden.split(chunk), target_hidden.split(chunk), strict=True)]
    return tuple(torch.cat(parts) for parts in zip(*out, strict=True))  # type: ignore[return-value]


def _chunk_kls(draft_hidden: Tensor, target_hidden: Tensor, head: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    acc = torch.promote_types(draft_hidden.dtype, torch.float32)
    log_q = F.log_softmax(F.linear(draft_hidden, head.to(draft_hidden.dtype)).to(acc), dim=-1)  # [R, V]
    t_logits = F.linear(target_hidden.to(head.dtype), head).to(acc)
    log_p = F.log_softmax(t_logits, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    return (p * (log_p - log_q)).sum(-1), (q * (log_q - log_p)).sum(-1), t_logits.argmax(-1)


def greedy_drafts(hidden: Tensor, head: Tensor, chunk: int) -> Tensor:
    """Each slot's argmax through the frozen head, the drafting rule of a preset without a decoding part, `chunk`
    rows at a time.  # [N]"""
    with torch.no_grad():
        return torch.cat([F.linear(h, head.to(h.dtype)).argmax(-1) for h in hidden.split(chunk)])


def replay_mask_mod(position_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int):
    """The attention rule of a replay sequence `[row (T); blocks (A*B)]`: the row causal within each document (as
    its feature forward), block a's slot j sees the row's document strictly before its anchor and its own slots
    0..j (causal: the target reads the draft left to right)."""
    total = position_ids.numel()
    doc = packed_documents(position_ids)  # [T]
    anchor_doc = doc[anchors]

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_row, k_row = q_idx < total, kv_idx < total
        qr, kr = q_idx.clamp(max=total - 1), kv_idx.clamp(max=total - 1)
        block = ((q_idx - total) // block_size).clamp(0, anchors.numel() - 1)
        row_to_row = q_row & k_row & (doc[qr] == doc[kr]) & (kv_idx <= q_idx)
        block_to_row = ~q_row & k_row & anchor_valid[block] & (doc[kr] == anchor_doc[block]) & (kr < anchors[block])
        block_to_block = ~q_row & ~k_row & ((kv_idx - total) // block_size == block) & (kv_idx <= q_idx)
        return row_to_row | block_to_row | block_to_block

    return mask_mod


def replay_mask(position_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int,
                dense: bool, tile: int = 128) -> Tensor | BlockMask:
    """`replay_mask_mod` for the target's attention: dense `[1, 1, N, N]` (SDPA), or a BlockMask from each query's
    visible key ranges (flex attention, no `[N, N]` tensor)."""
    total, n = position_ids.numel(), position_ids.numel() + anchors.numel() * block_size
    mask_mod = replay_mask_mod(position_ids, anchors, anchor_valid, block_size)
    if dense:
        return create_mask(mask_mod, None, None, n, n, device=position_ids.device)
    device = position_ids.device
    index = torch.arange(total, device=device)
    doc = packed_documents(position_ids)
    doc_start = torch.cummax(torch.where(doc != torch.roll(doc, 1), index, 0), 0).values  # [T]
    anchor = anchors.repeat_interleave(block_size)  # [A*B]
    ctx_lo = doc_start[anchor]
    ctx_hi = torch.where(anchor_valid.repeat_interleave(block_size), anchor, ctx_lo)
    slot = torch.arange(anchors.numel() * block_size, device=device)
    blk_lo, blk_hi = total + slot - slot % block_size, total + slot + 1
    empty = torch.zeros(total, dtype=index.dtype, device=device)
    return interval_block_mask(
        [(torch.cat([doc_start, ctx_lo]), torch.cat([index + 1, ctx_hi])),
         (torch.cat([empty, blk_lo]), torch.cat([empty, blk_hi]))], n, tile, mask_mod)


def replay(target: FeatureExtractor, input_ids: Tensor, position_ids: Tensor, anchors: Tensor, anchor_valid: Tensor,
           block_tokens: Tensor) -> Tensor:
    """The target's final normed hidden states at every slot of the draft blocks `block_tokens [A, B]` (slot 0 the
    anchor's token, then the drafts), each block after its row's context up to its anchor: one target forward of
    `[row; blocks]`.  # [A, B, H]

    State j of a block predicts the token after its slot j: the target's distribution at slot j + 1 given the
    draft's own tokens before it."""
    if target.dense_mask is None:
        raise ConfigError("model.opd.replay: the target's attention takes no mask of a replay "
                          "(target.attn_implementation auto, sdpa or flex_attention do)")
    a, b = block_tokens.shape
    ids = torch.cat([input_ids, block_tokens.flatten()])
    positions = torch.cat([position_ids, (position_ids[anchors][:, None] + torch.arange(b, device=anchors.device))
                           .flatten()])
    mask = replay_mask(position_ids, anchors, anchor_valid, b, dense=target.dense_mask)
    return target.final_states(ids, positions, mask)[input_ids.numel():].view(a, b, -1)


__all__ = ["OPDSettings", "accept_mask", "greedy_drafts", "opd_loss", "replay", "replay_mask", "replay_mask_mod",
           "slot_kls"]
