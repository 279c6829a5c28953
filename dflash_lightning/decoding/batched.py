"""Speculative decoding of N prompts at once at static shapes: tau at scale, and batch-1 speed with CUDA graphs.

All rows share one slot timeline: the prefill writes each prompt left-padded into slots 0..P-1, every decode step
writes the block [x, drafts...] of every row into the next slots, and a per-row validity mask hides the slots of
padding and rejected drafts from then on (their K/V stay, unseen). True positions per row go to RoPE; the target
gets a 4D mask `[N, 1, q, slots]` (transformers passes a 4D mask through as is) and a `SlotCache`; the drafter
keeps its context K/V on the same slots. Tokens, accepted lengths and random streams per row are those of the
one-prompt `SpeculativeDecoder.generate`, whose verification rule (`verify_drafts`) this one shares.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lightning.blocks import window_rule
from dflash_lightning.decoding.speculative import Generation, _cache_arg, _decoding, _now, _truncate
from dflash_lightning.hf.modeling_dflash import accepted_lengths, next_token, verify_drafts
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.base import Draft, DraftInputs


class SlotCache:
    """The target's K/V of a batch on its slot timeline, written at `slots`: a transformers cache by duck typing (the
    forward calls only `update` when given positions and a 4D mask)."""

    is_compileable = True

    def __init__(self, layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * layers  # [N, kv_heads, slots, D] each
        self.values: list[Tensor | None] = [None] * layers
        self.capacity = 0
        self.slots: Tensor | None = None
        """Where the next forward writes its q tokens.  # [q]"""

    def reset(self, capacity: int) -> None:
        """Start a new batch of `capacity` slots (buffers of the same shape are reused: static addresses)."""
        if capacity != self.capacity:
            self.keys, self.values = [None] * len(self.keys), [None] * len(self.values)
        self.capacity = capacity

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        """Write `[N, kv_heads, q, D]` at `slots`; every slot's K/V (the mask says which are seen)."""
        keys = self.keys[layer_idx]
        if keys is None or keys.shape[0] != key_states.shape[0] or keys.dtype != key_states.dtype:
            shape = (key_states.shape[0], key_states.shape[1], self.capacity, key_states.shape[-1])
            # zeros, not empty: a slot never written is masked, but NaN garbage would survive a 0 attention weight
            self.keys[layer_idx] = keys = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape[:-1] + value_states.shape[-1:])
            if not torch.compiler.is_compiling():  # graphs replay against these addresses (as StaticCache does)
                torch._dynamo.mark_static_address(keys)
                torch._dynamo.mark_static_address(self.values[layer_idx])
        keys.index_copy_(2, self.slots, key_states)
        self.values[layer_idx].index_copy_(2, self.slots, value_states)
        return keys, self.values[layer_idx]

    def gather(self, order: Tensor) -> None:
        """Reorder every row's slots by `order [N, slots]` in place (compaction)."""
        for buffers in (self.keys, self.values):
            for t in buffers:
                if t is not None:
                    t.copy_(t.gather(2, order[:, None, :, None].expand_as(t)))


class BatchedDraftContext:
    """The drafter's context K/V per layer of a batch, on the target's slots (`DraftContext` of N rows)."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.rules = [drafter.config.attention_rule(i) for i in range(len(drafter.layers))]  # (window, causal)
        self.keys: list[Tensor | None] = [None] * len(self.rules)  # [N, slots, kv_heads, D] each
        self.values: list[Tensor | None] = [None] * len(self.rules)

    def reset(self, rows: int, capacity: int, like: Tensor) -> None:
        """Buffers for `rows` x `capacity` slots (reused where the shape holds: static addresses)."""
        attn = self.drafter.layers[0].self_attn
        shape = (rows, capacity, attn.num_kv_heads, attn.head_dim)
        dtype = self.drafter.compute_dtype()
        for i in range(len(self.rules)):
            if self.keys[i] is None or self.keys[i].shape != shape or self.keys[i].dtype != dtype:
                self.keys[i] = torch.zeros(shape, dtype=dtype, device=like.device)
                self.values[i] = torch.zeros(shape, dtype=dtype, device=like.device)
                torch._dynamo.mark_static_address(self.keys[i])  # read by the drafter's graph in place, not copied
                torch._dynamo.mark_static_address(self.values[i])

    def write(self, features: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Context K/V of target features `[N, q, K*H]` at `positions [N, q]` into `slots [q]`; the context
        vectors.  # [N, q, H]"""
        d = self.drafter
        c = d.context(features)  # [N, q, H]
        rope = d.rotary(positions.flatten(), c.dtype)
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.key_value(c.flatten(0, 1), *rope)  # [N*q, kv_heads, D]
            self.keys[i].index_copy_(1, slots, k.unflatten(0, c.shape[:2]))
            self.values[i].index_copy_(1, slots, v.unflatten(0, c.shape[:2]))
        return c

    def block_hidden(self, block: Tensor, start: Tensor, valid: Tensor, slot_pos: Tensor) -> Tensor:
        """Final-normed hidden states of blocks `[N, B]` at positions start..start+B-1 over each row's `valid` context
        slots (at positions `slot_pos`), `[N, slots]` both.  # [N, B, H]"""
        d = self.drafter
        N, B = block.shape
        x = d.embed(block.flatten())  # [N*B, H]
        block_pos = start[:, None] + torch.arange(B, device=block.device)  # [N, B]
        rope = d.rotary(block_pos.flatten(), x.dtype)
        masks = {rule: self._mask(rule, block_pos, valid, slot_pos) for rule in dict.fromkeys(self.rules)}
        for i, layer in enumerate(d.layers):
            x = layer.block_forward(x, partial(self._attend, i, layer.self_attn, rope, masks[self.rules[i]], N))
        return d.norm(x).unflatten(0, (N, B))

    @staticmethod
    def _mask(rule: tuple[int | None, bool], block_pos: Tensor, valid: Tensor, slot_pos: Tensor) -> Tensor:
        """One rule's keep-mask `[N, 1, B, slots + B]`: valid context slots and the block, under `window_rule`."""
        query = block_pos[:, :, None]  # [N, B, 1]
        no, yes = torch.zeros((), dtype=torch.bool, device=valid.device), torch.ones((), dtype=torch.bool,
                                                                                      device=valid.device)
        context = valid[:, None, :] & window_rule(query, slot_pos[:, None, :], no, *rule)  # [N, B, slots]
        own = window_rule(query, block_pos[:, None, :], yes, *rule)
        own = own.expand(query.shape[0], query.shape[1], query.shape[1]) if isinstance(own, Tensor) else \
            torch.ones_like(context[:, :, :1]).expand(-1, -1, query.shape[1])
        return torch.cat([context, own], -1)[:, None]

    def _attend(self, i: int, attn: nn.Module, rope, mask: Tensor, rows: int, h: Tensor) -> Tensor:
        """Layer i's attention of normed block tokens `h [N*B, H]` over its context slots and the block."""
        q = attn.query(h, *rope).unflatten(0, (rows, -1)).transpose(1, 2)  # [N, heads, B, D]
        k, v = (t.unflatten(0, (rows, -1)) for t in attn.key_value(h, *rope))  # [N, B, kv_heads, D]
        k = torch.cat([self.keys[i], k], 1).transpose(1, 2)  # [N, kv_heads, slots + B, D]
        v = torch.cat([self.values[i], v], 1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [N, heads, B, D]
        return attn.o_proj(out.transpose(1, 2).flatten(2).flatten(0, 1))


class BatchedDecoder:
    """Speculative decoding (greedy or sampled) and the target alone, of N prompts together at static shapes.

    `graphs`: on CUDA, the target's step (verify: the block's q tokens; alone: 1 token) and the drafter's block step
    run as CUDA graphs (`torch.compile(mode="reduce-overhead")`); elsewhere they run eagerly, the same code.
    """

    def __init__(self, target_model: nn.Module, drafter: DFlashDrafter, graphs: bool = False) -> None:
        from dflash_lightning.decoding.speculative import SpeculativeDecoder

        one = SpeculativeDecoder(target_model, drafter)  # the one-prompt decoder's settings (and the target's IO)
        self.target, self.drafter = target_model, drafter
        self.layer_ids, self.mask_token_id, self.block_size = one.layer_ids, one.mask_token_id, one.block_size
        self.draft_slots, self.drafts = one.draft_slots, one.drafts
        self.cache_arg = _cache_arg(target_model)
        self.cache = SlotCache(target_model.config.num_hidden_layers)
        self.context = BatchedDraftContext(drafter)
        self.rule = next((part for part in drafter.parts if part.decodes), None)
        self._target_step, self._draft_step = self._target_forward, self._block_logits
        device = next(target_model.parameters()).device
        self.graphs = graphs and device.type == "cuda"
        if self.graphs:  # the CUDA-only lines: fixed shapes, replayed as graphs
            self._target_step = torch.compile(self._target_forward, mode="reduce-overhead", dynamic=False)
            self._draft_step = torch.compile(self._block_logits, mode="reduce-overhead", dynamic=False)

    # -- the steps (static shapes)
    def _target_forward(self, ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                        logits_to_keep: int = 0) -> tuple[Tensor, Tensor]:
        """Target logits `[N, q, V]` of tokens `ids [N, q]` at `positions` written at `slots [q]` under the keep-mask
        `[N, 1, q, slots]`, and their context features `[N, q, K*H]`."""
        self.cache.slots = slots
        out = self.target(input_ids=ids, position_ids=positions, attention_mask=mask, **{self.cache_arg: self.cache},
                          use_cache=True, output_hidden_states=True, logits_to_keep=logits_to_keep)
        return out.logits, torch.cat([out.hidden_states[j + 1] for j in self.layer_ids], -1)

    def _block_logits(self, block: Tensor, start: Tensor, valid: Tensor, slot_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The blocks' hidden states `[N, B, H]` and the drafting slots' logits `[N, drafts, V]`."""
        hidden = self.context.block_hidden(block, start, valid, slot_pos)
        return hidden, self.drafter.logits(hidden[:, self.draft_slots])

    def _step_begins(self) -> None:
        """A new decode step: the graphs may overwrite the last step's outputs (all read by now)."""
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()

    # -- the slot timeline
    def _prefill(self, prompts: Sequence[Tensor], capacity: int, with_drafter: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Write the prompts left-padded into slots 0..P-1: the last prompt token's logits `[N, V]`, each row's
        valid slots and slot positions `[N, capacity]`; the drafter's context too where drafting."""
        device = prompts[0].device
        N, P = len(prompts), max(p.numel() for p in prompts)
        lengths = torch.tensor([p.numel() for p in prompts], device=device)
        ids = torch.stack([F.pad(p.flatten(), (P - p.numel(), 0)) for p in prompts])  # [N, P]
        slot = torch.arange(P, device=device)
        in_prompt = slot[None] >= (P - lengths)[:, None]  # [N, P]
        positions = (slot[None] - (P - lengths)[:, None]).clamp(min=0)
        # a padding query sees itself only: its states stay finite (never seen by real tokens)
        mask = (in_prompt[:, None, :] & (slot[None, :, None] >= slot[None, None, :])) | torch.eye(
            P, dtype=torch.bool, device=device)  # [N, P (query), P (key)]
        self.cache.reset(capacity)
        mask = F.pad(mask, (0, capacity - P))[:, None]  # [N, 1, P, capacity]
        logits, features = self._target_forward(ids, positions, slot, mask, logits_to_keep=1)
        valid = F.pad(in_prompt, (0, capacity - P))
        slot_pos = F.pad(positions, (0, capacity - P))
        if with_drafter:
            self.context.reset(N, capacity, ids)
            self.last_context = self.context.write(features, positions, slot)[:, -1]  # [N, H]: c_{p-1}
        return logits[:, -1], valid, slot_pos

    def _compact(self, valid: Tensor, slot_pos: Tensor) -> int:
        """Move every row's valid slots to its front (target and drafter K/V alike); the next free slot."""
        order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices  # valid slots first, in order
        self.cache.gather(order)
        for buffers in (self.context.keys, self.context.values):
            for t in buffers:
                if t is not None:
                    t.copy_(t.gather(1, order[:, :, None, None].expand_as(t)))
        valid.copy_(valid.gather(1, order))
        slot_pos.copy_(slot_pos.gather(1, order))
        return int(valid.sum(1).max())

    # -- decoding
    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Tensor], max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        generators: Sequence[torch.Generator | None] | None = None, capacity: int | None = None,
    ) -> list[Generation]:
        """`SpeculativeDecoder.generate` of every prompt `[P_i]` (row i samples from `generators[i]`): the same tokens,
        accepted lengths and expected counts; every row's `seconds` is the whole batch's decode time. `capacity`:
        slots per row (default: the longest prompt + max_new_tokens + 4 blocks; full, the rows are compacted)."""
        sampling, stop = _decoding(eos_token_id, temperature, top_p, top_k, None)
        N, q, device = len(prompts), self.drafts + 1, prompts[0].device
        generators = list(generators) if generators is not None else [None] * N
        P = max(p.numel() for p in prompts)
        capacity = capacity or P + max_new_tokens + 4 * q
        if capacity < P + max_new_tokens + q:
            raise ValueError(f"capacity {capacity} < longest prompt {P} + max_new_tokens {max_new_tokens} + block {q}")
        t0 = _now(device)
        logits, valid, slot_pos = self._prefill(prompts, capacity, with_drafter=True)
        x = self._first_tokens(logits, sampling, generators)  # [N]
        tokens = [[t] for t in x.tolist()]
        accepted, expected = [[] for _ in range(N)], [[] for _ in range(N)]
        extras: list[dict[str, list[list[float]]]] = [{} for _ in range(N)]
        done = [max_new_tokens <= 1 or t[0] in stop for t in tokens]
        start = torch.tensor([p.numel() for p in prompts], device=device)  # position of x
        cur, arange_q = P, torch.arange(q, device=device)
        t1 = _now(device)
        while not all(done):
            self._step_begins()
            if cur + q > capacity:
                cur = self._compact(valid, slot_pos)
            block = torch.full((N, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
            block[:, 0] = x
            hidden, draft_logits = self._draft_step(block, start, valid, slot_pos)
            drafted = self._drafts(hidden, draft_logits, x, temperature, generators, done)
            # as the one-prompt decoder: a row verifies only the tokens it still wants (the rest of its block is
            # written and never seen); the block itself is drafted whole
            wanted = [min(q, max_new_tokens - len(t)) for t in tokens]
            ids = torch.cat([x[:, None], torch.stack([d.tokens for d in drafted])], 1)  # [N, q]
            positions, slots = start[:, None] + arange_q, cur + arange_q
            own = slots[None, :] <= slots[:, None]  # [q (query), q (key)]: causal inside the block
            mask = valid[:, None, None, :].expand(N, 1, q, capacity).clone()
            mask[:, :, :, cur: cur + q] = own
            slot_pos[:, cur: cur + q] = positions
            logits, features = self._target_step(ids, positions, slots, mask)
            a, bonus, expected_a = self._verify(ids, logits, drafted, wanted, sampling, generators)
            emitted = torch.tensor([0 if done[i] else a[i] + 1 for i in range(N)], device=device)  # [N]
            valid[:, cur: cur + q] = arange_q[None] < emitted[:, None]
            c = self.context.write(features, positions, slots)  # [N, q, H]
            last = (emitted - 1).clamp(min=0)
            keep = emitted > 0
            self.last_context = torch.where(keep[:, None], c[torch.arange(N, device=device), last], self.last_context)
            start = start + emitted
            x = torch.where(keep, bonus, x)
            cur += int(emitted.max())
            for i in range(N):
                if done[i]:
                    continue
                new = ids[i, 1: a[i] + 1].tolist() + [int(bonus[i])]
                tokens[i] += new
                accepted[i].append(a[i])
                expected[i].append(expected_a[i])
                for name, values in drafted[i].extras.items():  # of the whole block, as drafted
                    extras[i].setdefault(name, []).append(values.tolist())
                done[i] = len(tokens[i]) >= max_new_tokens or any(t in stop for t in new)
        seconds = _now(device) - t1
        return [Generation(_truncate(tokens[i], max_new_tokens, stop), accepted[i], len(accepted[i]), seconds,
                           t1 - t0, expected[i], extras[i]) for i in range(N)]

    def _first_tokens(self, logits: Tensor, sampling: dict, generators: Sequence[torch.Generator | None]) -> Tensor:
        """The token after each prompt: argmax, or a sample of row i's stream.  # [N]"""
        if sampling["temperature"] == 0:
            return logits.argmax(-1)
        return torch.stack([next_token(logits[i], **{**sampling, "generator": g}) for i, g in enumerate(generators)])

    def _drafts(self, hidden: Tensor, logits: Tensor, x: Tensor, temperature: float,
                generators: Sequence[torch.Generator | None], done: list[bool]) -> list[Draft]:
        """Every row's drafts: the backbone's argmax at once, or the drafting part's rule row by row (its `draft` takes
        one block; a finished row gets the argmax without drawing from its stream)."""
        argmax = logits.argmax(-1)  # [N, drafts]
        if self.rule is None:
            return [Draft(t) for t in argmax]
        return [Draft(argmax[i]) if done[i] else self.rule.draft(DraftInputs(
            hidden[i, self.draft_slots], logits[i], x[i], self.last_context[i], self.drafter.embed_weight, temperature,
            generators[i], hidden[i])) for i in range(x.shape[0])]

    def _verify(self, ids: Tensor, logits: Tensor, drafted: list[Draft], wanted: list[int], sampling: dict,
                generators: Sequence[torch.Generator | None]) -> tuple[list[int], Tensor, list[float]]:
        """`verify_drafts` of every row over its first `wanted[i]` block tokens: accepted drafts, the token after
        them `[N]`, the expected accepted counts. Greedy rows at once (`accepted_lengths`), sampled row by row."""
        if sampling["temperature"] == 0:
            posterior = logits.argmax(-1)  # [N, q]
            slot = torch.arange(1, ids.shape[1], device=ids.device)
            cut = slot[None] < torch.tensor(wanted, device=ids.device)[:, None]  # [N, q - 1]: the drafts verified
            a = accepted_lengths(torch.where(cut, ids[:, 1:], -1), posterior)  # [N]
            bonus = posterior.gather(1, a[:, None])[:, 0]
            a = a.tolist()
            return a, bonus, [float(n) for n in a]
        out = [verify_drafts(ids[i, 1: n], logits[i, :n], **{**sampling, "generator": generators[i]},
                             draft_probs=None if d.q is None else d.q[: n - 1])
               if n > 0 else (0, ids[i, 0], 0.0)  # a finished row: nothing verified, nothing drawn
               for i, (d, n) in enumerate(zip(drafted, wanted, strict=True))]
        return [o[0] for o in out], torch.stack([o[1] for o in out]), [o[2] for o in out]

    @torch.no_grad()
    def target_generate(
        self, prompts: Sequence[Tensor], max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        generators: Sequence[torch.Generator | None] | None = None, capacity: int | None = None,
    ) -> list[Generation]:
        """`target_generate` of every prompt (the target alone, one token a step, row i from `generators[i]`) on the
        same slots; every row's `seconds` is the whole batch's decode time."""
        sampling, stop = _decoding(eos_token_id, temperature, top_p, top_k, None)
        N, device = len(prompts), prompts[0].device
        generators = list(generators) if generators is not None else [None] * N
        P = max(p.numel() for p in prompts)
        capacity = capacity or P + max_new_tokens + 4 * (self.drafts + 1)
        if capacity < P + max_new_tokens:
            raise ValueError(f"capacity {capacity} < longest prompt {P} + max_new_tokens {max_new_tokens}")
        t0 = _now(device)
        logits, valid, slot_pos = self._prefill(prompts, capacity, with_drafter=False)
        x = self._first_tokens(logits, sampling, generators)
        tokens = [[t] for t in x.tolist()]
        done = [max_new_tokens <= 1 or t[0] in stop for t in tokens]
        start = torch.tensor([p.numel() for p in prompts], device=device)
        cur, steps = P, 0
        t1 = _now(device)
        while not all(done):
            self._step_begins()
            slots = torch.tensor([cur], device=device)
            mask = valid.clone()
            mask[:, cur] = True
            slot_pos[:, cur] = start
            logits, _ = self._target_step(x[:, None], start[:, None], slots, mask[:, None, None])
            x = self._first_tokens(logits[:, -1], sampling, generators)
            active = torch.tensor([not d for d in done], device=device)
            valid[:, cur] = active
            start, cur, steps = start + active.long(), cur + 1, steps + 1
            for i, t in enumerate(x.tolist()):
                if not done[i]:
                    tokens[i].append(t)
                    done[i] = len(tokens[i]) >= max_new_tokens or t in stop
        seconds = _now(device) - t1
        # steps per row: its own tokens after the first (a row that finished early stepped along harmlessly)
        return [Generation(tokens[i], steps=len(tokens[i]) - 1, seconds=seconds, prefill_seconds=t1 - t0)
                for i in range(N)]


__all__ = ["BatchedDecoder", "BatchedDraftContext", "SlotCache"]
