"""Batched decoding (decoding/batched.py) is the one-prompt decoder's, row for row: every preset's tokens, accepted
lengths, expected counts and extras, greedy and sampled from the same streams (so the one-prompt decoder's exact
chi-square tests carry over), prompts of different lengths in one batch; drafts that leave holes and a full slot
timeline (compaction) keep the drafter's state the training forward's; the target alone equals `target_generate`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_contract import VARIANTS, random_drafter
from test_evaluate import PROMPTS
from test_speculative import SLIDING, assert_drafts_are_the_training_forwards, random_prompts
from test_speculative import random_drafter as plain_drafter
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_lightning.decoding.batched import BatchedDecoder
from dflash_lightning.decoding.evaluate import evaluate
from dflash_lightning.decoding.speculative import SpeculativeDecoder, target_generate
from dflash_lightning.parts.base import Draft

EOS = 2  # <|im_end|> of the test tokenizer


@pytest.fixture(scope="module")
def target(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def streams(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_decoding_is_the_one_prompt_decoders_for_every_preset(tiny_target, target, variant):
    """Four prompts of 2..23 tokens in one batch, a stop token on, block 4: at T 0 and at T 1 (top-k 20, row i from
    stream i) every row's tokens, accepted lengths, expected counts and drafting extras are those of
    `SpeculativeDecoder.generate` alone with the same stream; the target alone, batched, is `target_generate`."""
    drafter = random_drafter(tiny_target, variant, seed=1, block_size=4)
    one, many = SpeculativeDecoder(target, drafter), BatchedDecoder(target, drafter)
    prompts = random_prompts(4, seed=2)
    assert len({p.numel() for p in prompts}) == 4
    for sampling in ({}, {"temperature": 1.0, "top_k": 20}):
        batched = many.generate(prompts, 12, EOS, **sampling, generators=streams(4))
        alone = many.target_generate(prompts, 12, EOS, **sampling, generators=streams(4))
        for prompt, out, base, g, h in zip(prompts, batched, alone, streams(4), streams(4), strict=True):
            ref = one.generate(prompt, 12, EOS, **sampling, generator=g)
            assert out.tokens == ref.tokens and out.accepted_lengths == ref.accepted_lengths, sampling
            assert out.expected_accepted == pytest.approx(ref.expected_accepted, rel=1e-4, abs=1e-5)
            assert out.extras.keys() == ref.extras.keys()
            for name in ref.extras:
                torch.testing.assert_close(torch.tensor(out.extras[name]), torch.tensor(ref.extras[name]))
            assert base.tokens == target_generate(target, prompt, 12, EOS, **sampling, generator=h).tokens


class OracleBatched(BatchedDecoder):
    """Drafts each row's target greedy continuation, wrong from a random slot on (`OracleDecoder` of
    test_speculative.py for N rows), records each active row's step (start, x, drafter logits) and counts
    compactions."""

    def __init__(self, target_model, drafter, truths: list[list[int]], prompts: list[torch.Tensor], seed: int) -> None:
        super().__init__(target_model, drafter)
        self.truths, self.lengths = truths, [p.numel() for p in prompts]
        self.g = torch.Generator().manual_seed(seed)
        self.expected, self.steps = [[] for _ in prompts], [[] for _ in prompts]
        self.compactions = 0

    def _block_logits(self, block, start, valid, slot_pos):
        hidden, logits = super()._block_logits(block, start, valid, slot_pos)
        self.start = start.tolist()
        return hidden, logits

    def _compact(self, valid, slot_pos):
        self.compactions += 1
        return super()._compact(valid, slot_pos)

    def _drafts(self, hidden, logits, x, temperature, generators, done):
        super()._drafts(hidden, logits, x, temperature, generators, done)  # the real drafting path runs too
        B, out = self.block_size, []
        for i, truth in enumerate(self.truths):
            k = self.start[i] - self.lengths[i]  # x is truth[k]
            right = torch.tensor((truth + [0] * 64)[k + 1: k + B])
            wrong = int(torch.randint(1, B + 1, (1,), generator=self.g))
            if not done[i]:
                self.expected[i].append(min(wrong - 1, min(B, len(truth) - k - 1) - 1))
                self.steps[i].append((self.start[i], int(x[i]), logits[i]))
            out.append(Draft(torch.where(torch.arange(1, B) < wrong, right, (right + 1) % 50)))
        return out


@pytest.mark.parametrize("capacity", ["default", "tight"])
def test_holes_and_compaction_keep_the_drafters_state(target, capacity):
    """Rows accepting 0..B-1 drafts leave holes on the shared timeline; with the fewest slots that fit (`tight`) the
    rows are compacted over and over. Every row still emits the target's tokens, accepts exactly the drafts that were
    right, and each step's drafter logits are the training forward's over the row's verified prefix (sliding layers'
    windows included)."""
    drafter = plain_drafter(target, 4, layers=2, **SLIDING)
    prompts, n = random_prompts(3, seed=7), 20
    truths = [target_generate(target, p, n).tokens for p in prompts]
    decoder = OracleBatched(target, drafter, truths, prompts, seed=0)
    tight = max(p.numel() for p in prompts) + n + 4
    outs = decoder.generate(prompts, n, capacity=tight if capacity == "tight" else None)
    assert (decoder.compactions > 0) == (capacity == "tight")
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.tokens == truths[i] and out.accepted_lengths == decoder.expected[i]
        assert {0, 3} <= set(out.accepted_lengths)
        row = SimpleNamespace(steps=decoder.steps[i], target=target, layer_ids=decoder.layer_ids, drafter=drafter,
                              draft_slots=decoder.draft_slots)
        assert_drafts_are_the_training_forwards(row, prompt, out.tokens)
    with pytest.raises(ValueError, match="capacity"):
        decoder.generate(prompts, n, capacity=tight - 1)


def test_evaluate_in_batches_reports_what_one_at_a_time_does(tiny_target, target):
    """`evaluate(batch_size=3)` over four prompts (a full batch and a short one), greedy and sampled: every prompt's
    record but its seconds is the one-at-a-time report's, and so are tau and the mismatch count."""
    drafter = random_drafter(tiny_target, "dflash", seed=3, block_size=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    for temperature in (0.0, 1.0):
        runs = [evaluate(drafter, target, tokenizer, PROMPTS, max_new_tokens=10, progress=False, warmup=False,
                         temperature=temperature, seed=5, batch_size=b) for b in (1, 3)]
        assert [r["batch_size"] for r in runs] == [1, 3]
        inexact = ("speculative_seconds", "target_seconds", "expected_accepted")  # fp32 sums in another order
        one, many = ([{k: v for k, v in p.items() if k not in inexact} for p in r["prompts"]] for r in runs)
        assert one == many
        for a, b in zip(*(r["prompts"] for r in runs), strict=True):
            assert a["expected_accepted"] == pytest.approx(b["expected_accepted"], rel=1e-4, abs=1e-5)
        assert runs[0]["tau_pooled"] == runs[1]["tau_pooled"] and runs[0]["mismatches"] == runs[1]["mismatches"]
        assert runs[1]["speedup"] > 0
