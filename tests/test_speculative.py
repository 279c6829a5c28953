"""Speculative decoding is lossless, the accept rule is the contract's, cached drafting equals training."""

from __future__ import annotations

import pytest
import torch
from helpers import packed_batch
from transformers import AutoModelForCausalLM

from dflash_lightning.config import DrafterConfig
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.speculative import DraftContext, SpeculativeDecoder, accepted_length, target_generate
from dflash_lightning.target import load_target_io

EOS = 2  # <|im_end|> of the test tokenizer



@pytest.fixture(scope="module")
def target(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def random_drafter(target_model, block_size: int, seed: int = 0, layers: int = 2, **attention) -> DFlashDrafter:
    """A random drafter for the target: its weights are noise, so it drafts (almost) nothing right."""
    cfg = DrafterConfig(num_layers=layers, block_size=block_size, mask_token_id=52, gamma=4.0, **attention)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg.resolved(target_model.config))
    for p in drafter.parameters():  # norms away from 1 so every weight matters
        p.data += 0.1 * torch.randn_like(p)
    return drafter.eval()


def random_prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g) for _ in range(n)]


def test_accept_rule_on_hand_made_blocks():
    # draft holds slots 1..4; posterior[j] is the target's token after block token j.
    post = torch.tensor([7, 8, 9, 10, 11])
    assert accepted_length(torch.tensor([7, 8, 9, 10]), post) == 4  # all accepted, bonus post[4]
    assert accepted_length(torch.tensor([7, 8, 5, 10]), post) == 2  # stops at the first miss
    assert accepted_length(torch.tensor([1, 8, 9, 10]), post) == 0  # later matches do not count
    assert accepted_length(torch.tensor([], dtype=torch.long), post[:1]) == 0  # a block of one token


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_random_drafter_is_lossless(target, block_size):
    decoder = SpeculativeDecoder(target, random_drafter(target, block_size, seed=block_size))
    for i, ids in enumerate(random_prompts(10, seed=block_size)):
        eos = EOS if i % 2 else None
        spec, base = decoder.generate(ids, 16, eos), target_generate(target, ids, 16, eos)
        assert spec.tokens == base.tokens, f"prompt {i}"
        # every step emits its accepted drafts and one bonus token; the prefill emits one token
        assert 1 + sum(a + 1 for a in spec.accepted_lengths) >= len(spec.tokens) > sum(spec.accepted_lengths)
        assert all(0 <= a < block_size for a in spec.accepted_lengths)
        assert spec.steps == len(spec.accepted_lengths)


class OracleDecoder(SpeculativeDecoder):
    """Drafts the target's own greedy continuation, wrong from a chosen slot on: a rigged, good drafter."""

    def __init__(self, target_model, drafter, truth: list[int], prompt_len: int, first_wrong_slot=None) -> None:
        super().__init__(target_model, drafter)
        self.truth, self.prompt_len, self.expected = truth, prompt_len, []
        self.first_wrong_slot = first_wrong_slot or (lambda: self.block_size)  # default: every draft right

    def draft(self, context, x, start):
        super().draft(context, x, start)  # run the real drafting path too
        k = start - self.prompt_len  # x is truth[k]
        right = torch.tensor((self.truth + [0] * 64)[k + 1: k + self.block_size], device=x.device)
        wrong = self.first_wrong_slot()
        # the decoder verifies only the drafts still wanted: len(truth) - (k + 1) tokens are left
        self.expected.append(min(wrong - 1, min(self.block_size, len(self.truth) - k - 1) - 1))
        return torch.where(torch.arange(1, self.block_size, device=x.device) < wrong, right, (right + 1) % 50)


@pytest.mark.parametrize("block_size", [4, 16])
def test_oracle_drafts_are_accepted_and_lossless(target, block_size):
    drafter = random_drafter(target, block_size)
    g = torch.Generator().manual_seed(block_size)
    for ids in random_prompts(6, seed=1):
        truth = target_generate(target, ids, 40).tokens
        decoder = OracleDecoder(target, drafter, truth, ids.numel(),
                                lambda: int(torch.randint(1, block_size + 1, (1,), generator=g)))
        spec = decoder.generate(ids, len(truth))
        assert spec.tokens == truth
        assert spec.accepted_lengths == decoder.expected  # exactly the drafts that were right
        assert max(spec.accepted_lengths) > 1


def test_stop_token_inside_an_accepted_block(target):
    ids = random_prompts(1, seed=3)[0]
    truth = target_generate(target, ids, 30).tokens
    stop = next(t for t in truth[5:] if t not in truth[:5])  # first appears mid-output
    expected = target_generate(target, ids, 30, stop).tokens
    assert expected[-1] == stop and len(expected) < 30
    decoder = OracleDecoder(target, random_drafter(target, 16), truth, ids.numel())
    spec = decoder.generate(ids, 30, stop)
    assert spec.tokens == expected
    # the last step emitted drafts past the stop token; tau counts only those up to it
    assert spec.accepted_lengths[-1] + 1 > spec.step_tokens[-1]
    assert spec.step_tokens[:-1] == [a + 1 for a in spec.accepted_lengths[:-1]]
    assert sum(spec.step_tokens) == len(expected) - 1


def test_max_new_tokens_is_exact(target):
    ids = random_prompts(1, seed=4)[0]
    truth = target_generate(target, ids, 23).tokens
    for n in (1, 2, 7, 8, 9, 23):
        decoder = OracleDecoder(target, random_drafter(target, 8), truth[:n], ids.numel())
        spec = decoder.generate(ids, n)
        assert spec.tokens == truth[:n] and spec.accepted_lengths == decoder.expected


SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}


@pytest.mark.parametrize("attention", [{}, SLIDING, {**SLIDING, "is_causal": False}], ids=["full", "sliding",
                                                                                         "sliding-bidir"])
def test_cached_drafting_equals_training_forward(tiny_target, target, attention):
    """DraftContext (context K/V appended chunk by chunk) gives block_hidden's states for the same anchor."""
    drafter = random_drafter(target, 8, **attention).double()
    drafter.set_target_io(*(w.double() for w in load_target_io(str(tiny_target))))
    docs, starts = [13, 9, 20], [0, 13, 22]
    batch = packed_batch(docs, 48, vocab=50, seed=5)
    features = torch.randn(48, 2 * 64, dtype=torch.float64)
    anchors = torch.tensor([0, 5, 12, 13, 21, 22, 30, 41])  # document starts, middles and ends
    hidden = drafter.block_hidden(features, batch["input_ids"], batch["position_ids"], batch["doc_ids"],
                                  anchors, torch.ones(8, dtype=torch.bool))
    for a, p in enumerate(anchors.tolist()):
        d = int(batch["doc_ids"][p])
        s = starts[d]
        context = DraftContext(drafter)
        for lo, hi in ((s, min(p, s + 3)), (min(p, s + 3), p)):  # two chunks, the first maybe empty
            if hi > lo:
                context.extend(features[lo:hi], batch["position_ids"][lo:hi])
        assert len(context) == p - s
        if attention and p > s:  # the sliding layer keeps only the W - 1 positions a later block can still see
            assert context.keys[0].shape[0] == min(p - s, 4) and context.keys[1].shape[0] == p - s
        block = torch.full((8,), 52)
        block[0] = batch["input_ids"][p]
        cached = context.block_hidden(block, p - s)
        torch.testing.assert_close(cached, hidden[a], rtol=1e-6, atol=1e-6)  # RoPE angles are fp32
        torch.testing.assert_close(drafter.logits(cached), drafter.logits(hidden[a]), rtol=1e-6, atol=1e-6)
