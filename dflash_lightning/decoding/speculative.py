"""Speculative decoding with a DFlash drafter, greedy or sampled (docs/method.md sections 6, 6b), and the target alone.

The drafter keeps the K/V of every context vector per layer and projects each one once; a block's own
K/V are never cached. The target keeps a Hugging Face KV cache that is cropped to the verified length.
The verification rule is the exported modelling file's (`hf/modeling_dflash.py`), so both decode alike.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from dflash_lightning.blocks import window_rule
from dflash_lightning.hf.modeling_dflash import accepted_length, check_sampling, next_token, verify_drafts
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.base import Draft, DraftInputs


@dataclass
class Generation:
    """What one generation returns."""

    tokens: list[int]
    """New tokens after the prompt, up to and including the first stop token."""
    accepted_lengths: list[int] = field(default_factory=list)
    """Accepted draft tokens a of every decode step (it emits a + 1); empty for the target alone."""
    steps: int = 0
    """Target forwards after the prefill."""
    seconds: float = 0.0
    """Wall time of the decode steps (prefill excluded)."""
    prefill_seconds: float = 0.0
    """Wall time of the prefill."""
    expected_accepted: list[float] = field(default_factory=list)
    """Expected accepted drafts of every decode step, `sum_k prod_{i<=k} P_k(d_k)` (a itself when greedy)."""
    extras: dict[str, list[list[float]]] = field(default_factory=dict)
    """A part's own values of every decode step's drafts (`Draft.extras`, e.g. DSpark's `confidence`), by name,
    one list per step; empty where the drafting rule has none."""

    @property
    def step_tokens(self) -> list[int]:
        """Tokens each decode step counts toward tau (docs/method.md section 6); see `counted_tokens`."""
        return counted_tokens([a + 1 for a in self.accepted_lengths], len(self.tokens) - 1)


def counted_tokens(emitted: list[int], kept: int) -> list[int]:
    """Tokens each decode step counts toward tau: what it emitted, up to the `kept` output tokens after the prefill's.

    `emitted[i]` is a + 1 of step i; `kept` is how many tokens the steps together left in the output (cut after the
    stop token and at the length limit), so the last step counts only its tokens up to the stop or the limit.
    """
    counts = []
    for n in emitted:
        counts.append(max(0, min(n, kept)))
        kept -= counts[-1]
    return counts


class DraftContext:
    """A drafter's cached context K/V per layer, at the true positions of the tokens they come from.

    A sliding layer of window W keeps only the last W - 1 context positions: the next block starts right after
    them, and its slot 0 sees no further back (docs/method.md 3b), so older K/V are never seen again. A layer's kept
    K/V are thus always the positions just before the block's `start`, as in the exported modelling file.
    """

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        n = len(drafter.layers)
        self.rules = [drafter.config.attention_rule(i) for i in range(n)]  # (window, causal) per layer
        self.keys: list[Tensor | None] = [None] * n
        self.values: list[Tensor | None] = [None] * n
        self.length = 0
        self.last_context: Tensor | None = None

    def __len__(self) -> int:
        """Context tokens seen so far (a sliding layer keeps only its window of them)."""
        return self.length

    @torch.no_grad()
    def extend(self, features: Tensor, positions: Tensor) -> None:
        """Append the context of new target features `[n, K*H]` at `positions [n]`, consecutive after the last."""
        c = self.drafter.context(features)  # [n, H]
        self.last_context = c[-1]  # c_{p-1} of the next block (parts read it: `DraftInputs.context_last`)
        rope = self.drafter.rotary(positions, c.dtype)
        self.length += positions.numel()
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.key_value(c, *rope)  # [n, kv_heads, D] each
            if self.keys[i] is not None:
                k, v = torch.cat([self.keys[i], k]), torch.cat([self.values[i], v])
            window = self.rules[i][0]
            drop = 0 if window is None else max(0, k.shape[0] - (window - 1))
            self.keys[i], self.values[i] = k[drop:], v[drop:]

    @torch.no_grad()
    def block_hidden(self, block_ids: Tensor, start: int) -> Tensor:
        """Final-normed hidden state of a block `[B]` at positions start..start+B-1 over all the context.  # [B, H]"""
        d = self.drafter
        x = d.embed(block_ids)  # [B, H]
        block_pos = torch.arange(start, start + block_ids.numel(), device=block_ids.device)
        rope = d.rotary(block_pos, x.dtype)
        for i, layer in enumerate(d.layers):
            x = layer.block_forward(x, partial(self._attend, i, layer.self_attn, rope, block_pos, start))
        return d.norm(x)

    def _attend(self, i: int, attn: nn.Module, rope, block_pos: Tensor, start: int, h: Tensor) -> Tensor:
        """Layer i's attention of the normed block tokens `h [B, H]` over its cached context K/V and the block."""
        k, v = attn.key_value(h, *rope)
        if self.keys[i] is not None:
            k, v = torch.cat([self.keys[i], k]), torch.cat([self.values[i], v])
        # Full layers: no mask, the block sees all of the context (all before `start`) and itself both ways.
        window, causal = self.rules[i]
        mask = None
        if window is not None or causal:
            kept = k.shape[0] - h.shape[0]  # this layer's context K/V: the positions just before `start`
            key_pos = torch.arange(start - kept, start + h.shape[0], device=block_pos.device)  # [kept + B]
            mask = window_rule(block_pos[:, None], key_pos[None, :], (key_pos >= start)[None, :], window, causal)
        return attn.attend(attn.query(h, *rope), k, v, mask)


class SpeculativeDecoder:
    """DFlash speculative decoding (greedy or sampled) of one sequence with a Hugging Face causal LM as the target."""

    def __init__(
        self, target_model: nn.Module, drafter: DFlashDrafter, layer_ids: list[int] | None = None,
        mask_token_id: int | None = None, block_size: int | None = None,
    ) -> None:
        """Layer ids, MASK id and block size default to the drafter's config."""
        cfg = drafter.config
        self.target, self.drafter = target_model, drafter
        self.layer_ids = list(layer_ids if layer_ids is not None else cfg.target_layer_ids)
        self.mask_token_id = mask_token_id if mask_token_id is not None else cfg.mask_token_id
        self.block_size = block_size or cfg.block_size
        self.draft_slots = cfg.layout.draft_slots(self.block_size)
        """The slots whose predictions are drafted (`BlockLayout.draft_slots`)."""
        self.drafts = cfg.layout.drafts(self.block_size)
        """Drafts per block: B - 1, or B in DSpark's anchor-first block (docs/method.md section 12)."""
        self.cache_arg = _cache_arg(target_model)
        if drafter.embed_weight is None:  # an in-memory drafter without its IO: take the target's own
            drafter.set_target_io(target_model.get_input_embeddings().weight,
                                  target_model.get_output_embeddings().weight)

    def _target(self, ids: Tensor, cache, logits_to_keep: int = 0) -> tuple[Tensor, Tensor]:
        """Target logits `[n, V]` (last `logits_to_keep` only if set) of new tokens `[n]` after the cached ones,
        and their context features `[n, K*H]` (`hidden_states[j + 1]`, docs/method.md section 1)."""
        out = self.target(input_ids=ids[None], **{self.cache_arg: cache}, use_cache=True,
                          output_hidden_states=True, logits_to_keep=logits_to_keep)
        return out.logits[0], torch.cat([out.hidden_states[j + 1][0] for j in self.layer_ids], -1)

    def draft(
        self, context: DraftContext, x: Tensor, start: int, temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Draft:
        """The drafts of the block `[x, MASK * (B-1)]` at `start` (the layout's drafting slots: fill-in 1..B-1
        predicting start+1..start+B-1, DSpark's anchor-first 0..B-1 predicting start+1..start+B), their draft
        distributions `[drafts, V]` where sampled (None: point masses) and the drafting part's extras.

        The backbone proposes each slot's argmax (method.md 6b); a part with its own drafting rule (`Part.decodes`:
        DFlash2's selector, section 10; DSpark's Markov head, 12) drafts instead, greedy or sampled from its q.
        """
        block = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long, device=x.device)
        block[0] = x
        block_hidden = context.block_hidden(block, start)  # [B, H]
        hidden = block_hidden[self.draft_slots]  # [drafts, H]
        logits = self.drafter.logits(hidden)
        rule = next((part for part in self.drafter.parts if part.decodes), None)
        if rule is None:
            return Draft(logits.argmax(-1))
        return rule.draft(DraftInputs(hidden, logits, x, context.last_context, self.drafter.embed_weight,
                                      temperature, generator, block_hidden))

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor, max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None,
    ) -> Generation:
        """Tokens after the prompt `input_ids [P]`: at temperature 0 identical to `target_generate`, above it
        distributed as `target_generate` with the same settings (`generator`: the random stream; None: torch's)."""
        from transformers import DynamicCache

        sampling, stop = _decoding(eos_token_id, temperature, top_p, top_k, generator)
        input_ids = input_ids.flatten()
        device = input_ids.device
        t0 = _now(device)
        cache = DynamicCache()
        logits, features = self._target(input_ids, cache, logits_to_keep=1)
        context = DraftContext(self.drafter)
        context.extend(features, torch.arange(input_ids.numel(), device=device))
        x = next_token(logits[-1], **sampling)
        tokens, accepted, expected, extras = [int(x)], [], [], {}
        t1 = _now(device)
        start = input_ids.numel()  # position of x, whose features the target has not made yet
        done = len(tokens) >= max_new_tokens or tokens[0] in stop
        while not done:
            drafted = self.draft(context, x, start, temperature, generator)
            # A step emits at most as many tokens as it verifies, so only the tokens still wanted are
            # verified; the block itself is always drafted whole, as in training.
            n = min(self.drafts + 1, max_new_tokens - len(tokens))
            block = torch.cat([x[None], drafted.tokens[: n - 1]])  # [n]
            logits, features = self._target(block, cache)
            q = None if drafted.q is None else drafted.q[: n - 1]  # [n - 1, V]
            a, bonus, expected_a = verify_drafts(block[1:], logits, **sampling, draft_probs=q)  # bonus: after a drafts
            _crop(cache, start + a + 1)  # drop the K/V of rejected drafts
            context.extend(features[: a + 1], torch.arange(start, start + a + 1, device=device))
            new = block[1: a + 1].tolist() + [int(bonus)]
            tokens += new
            accepted.append(a)
            expected.append(expected_a)
            for name, values in drafted.extras.items():  # of the whole block, as drafted
                extras.setdefault(name, []).append(values.tolist())
            x, start = bonus, start + a + 1
            done = len(tokens) >= max_new_tokens or any(t in stop for t in new)
        return Generation(_truncate(tokens, max_new_tokens, stop), accepted, len(accepted), _now(device) - t1,
                          t1 - t0, expected, extras)

    @torch.no_grad()
    def target_generate(self, input_ids: Tensor, max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
                        **sampling) -> Generation:
        """Plain decoding with the target alone and the same cache machinery (the speedup baseline)."""
        return target_generate(self.target, input_ids, max_new_tokens, eos_token_id, **sampling)


@torch.no_grad()
def target_generate(
    target_model: nn.Module, input_ids: Tensor, max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None,
) -> Generation:
    """Decoding with the target alone, one token per forward, through its KV cache: greedy at temperature 0, else
    sampled from its distribution with temperature, top-p and top-k applied."""
    from transformers import DynamicCache

    sampling, stop = _decoding(eos_token_id, temperature, top_p, top_k, generator)
    input_ids = input_ids.flatten()
    device = input_ids.device
    t0 = _now(device)
    cache_arg = {_cache_arg(target_model): DynamicCache()}
    out = target_model(input_ids=input_ids[None], **cache_arg, use_cache=True, logits_to_keep=1)
    x = next_token(out.logits[0, -1], **sampling)
    tokens = [int(x)]
    t1 = _now(device)
    steps = 0
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:  # one token per step: the last is the new one
        out = target_model(input_ids=x.view(1, 1), **cache_arg, use_cache=True)
        x = next_token(out.logits[0, -1], **sampling)
        tokens.append(int(x))
        steps += 1
    return Generation(tokens, steps=steps, seconds=_now(device) - t1, prefill_seconds=t1 - t0)


def _cache_arg(model: nn.Module) -> str:
    """The name a causal LM's forward takes its KV cache by: `cache` from transformers 5.24, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _decoding(eos_token_id: int | Iterable[int] | None, temperature: float, top_p: float, top_k: int,
              generator: torch.Generator | None) -> tuple[dict[str, Any], set[int]]:
    """The checked sampling settings (keyword arguments of `next_token`/`verify_drafts`) and the stop tokens."""
    check_sampling(temperature, top_p, top_k)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
    if eos_token_id is None:
        return sampling, set()
    return sampling, {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _truncate(tokens: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """Cut after the first stop token and at the token budget (a step may overshoot both)."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: min(i + 1, max_new_tokens)]
    return tokens[:max_new_tokens]


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (negative crop works in 4.x and 5.x)."""
    remove = cache.get_seq_length() - length
    if remove > 0:  # crop(0) means "keep nothing" in transformers 4
        cache.crop(-remove)


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # time what the GPU did, not what was queued
        torch.cuda.synchronize(device)
    return time.perf_counter()


__all__ = [
    "DraftContext", "Generation", "SpeculativeDecoder", "accepted_length", "counted_tokens", "target_generate",
]
