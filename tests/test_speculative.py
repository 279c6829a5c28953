"""Speculative decoding is lossless (greedy: token for token; sampled: in distribution, by exact chi-square tests),
the accept rule is the contract's, cached drafting equals training."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import packed_batch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_lightning.config import DrafterConfig
from dflash_lightning.decoding.speculative import DraftContext, SpeculativeDecoder, accepted_length, target_generate
from dflash_lightning.hf.modeling_dflash import sampling_probs, verify_drafts
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.base import Draft
from dflash_lightning.parts.convolutions import ConvSettings
from dflash_lightning.parts.selector import SelectorSettings
from dflash_lightning.target_model import load_target_io

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


@pytest.mark.parametrize("block_size", [*(pytest.param(b, marks=pytest.mark.pinned_only(  # the target's calls as
    same_path_as="tests/test_speculative.py::test_random_drafter_is_lossless[16]")) for b in (2, 4, 8)), 16])  # at 16
def test_random_drafter_is_lossless(target, block_size):
    """Greedy speculative decoding emits the target's own tokens (every preset's drafter: tests/test_contract.py)."""
    decoder = SpeculativeDecoder(target, random_drafter(target, block_size, seed=block_size))
    for i, ids in enumerate(random_prompts(10, seed=block_size)):
        eos = EOS if i % 2 else None
        spec, base = decoder.generate(ids, 16, eos), target_generate(target, ids, 16, eos)
        assert spec.tokens == base.tokens, f"prompt {i}"
        # every step emits its accepted drafts and one bonus token; the prefill emits one token
        assert 1 + sum(a + 1 for a in spec.accepted_lengths) >= len(spec.tokens) > sum(spec.accepted_lengths)
        assert all(0 <= a <= decoder.drafts for a in spec.accepted_lengths)  # drafts: B - 1, anchor-first B
        assert spec.steps == len(spec.accepted_lengths)
        assert spec.expected_accepted == [float(a) for a in spec.accepted_lengths]  # greedy: P_k(d_k) is 0 or 1


class OracleDecoder(SpeculativeDecoder):
    """Drafts the target's own greedy continuation, wrong from a chosen slot on: a rigged, good drafter."""

    def __init__(self, target_model, drafter, truth: list[int], prompt_len: int, first_wrong_slot=None) -> None:
        super().__init__(target_model, drafter)
        self.truth, self.prompt_len, self.expected = truth, prompt_len, []
        self.first_wrong_slot = first_wrong_slot or (lambda: self.block_size)  # default: every draft right

    def draft(self, context, x, start, *sampling):
        super().draft(context, x, start, *sampling)  # run the real drafting path too
        k = start - self.prompt_len  # x is truth[k]
        right = torch.tensor((self.truth + [0] * 64)[k + 1: k + self.block_size], device=x.device)
        wrong = self.first_wrong_slot()
        # the decoder verifies only the drafts still wanted: len(truth) - (k + 1) tokens are left
        self.expected.append(min(wrong - 1, min(self.block_size, len(self.truth) - k - 1) - 1))
        return Draft(torch.where(torch.arange(1, self.block_size, device=x.device) < wrong, right, (right + 1) % 50))


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
DFLASH2 = {"variant": "dflash2", "conv": ConvSettings(group_size=8), "selector": SelectorSettings(rank=4)}  # H 64, V 64


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


class RecordingDecoder(OracleDecoder):
    """Records every step's block start, first token and drafter logits of slots 1..B-1; drafts as the oracle does
    given `truth`, else the drafter's own drafts."""

    def __init__(self, target_model, drafter, truth=None, prompt_len: int = 0, first_wrong_slot=None) -> None:
        super().__init__(target_model, drafter, truth or [], prompt_len, first_wrong_slot)
        self.own, self.steps = truth is None, []

    def draft(self, context, x, start, *sampling):
        block = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long)
        block[0] = x
        self.steps.append((start, int(x), self.drafter.logits(context.block_hidden(block, start)[self.draft_slots])))
        if self.own:
            return SpeculativeDecoder.draft(self, context, x, start, *sampling)
        return super().draft(context, x, start, *sampling)


def assert_drafts_are_the_training_forwards(decoder: RecordingDecoder, prompt: torch.Tensor, tokens: list[int]):
    """Every step's drafter logits equal the training forward's (`block_hidden`) for the same anchor over the target
    features of the whole verified prefix, made in one target pass: the decoder's drafter state was right."""
    ids = torch.cat([prompt, torch.tensor(tokens)])  # [T]
    with torch.no_grad():
        states = decoder.target(input_ids=ids[None], output_hidden_states=True).hidden_states
    features = torch.cat([states[j + 1][0] for j in decoder.layer_ids], -1)  # [T, K*H]
    starts = torch.tensor([start for start, _, _ in decoder.steps])
    assert [x for _, x, _ in decoder.steps] == ids[starts].tolist()
    hidden = decoder.drafter.block_hidden(features, ids, torch.arange(ids.numel()), torch.zeros_like(ids),
                                          starts, torch.ones_like(starts, dtype=torch.bool))  # [steps, B, H]
    torch.testing.assert_close(torch.stack([logits for _, _, logits in decoder.steps]),
                               decoder.drafter.logits(hidden[:, decoder.draft_slots]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", [{}, SLIDING, {**SLIDING, "is_causal": False}, {**SLIDING, **DFLASH2}],
                         ids=["full", "sliding", "sliding-bidir", "dflash2"])
def test_decoder_drafts_are_the_training_forwards_step_by_step(target, attention):
    """Over whole generations (greedy with the oracle's drafts, so that steps accept 0..B-1 and the context grows by
    a + 1; sampled with the drafter's own), each step's drafter logits are the training forward's from the same
    prefix, a sliding layer's dropped K/V included. Losslessness holds for any drafts: only this catches a wrong
    drafter state in the decoding loop."""
    B = 4
    drafter = random_drafter(target, B, layers=2, **attention)
    g = torch.Generator().manual_seed(0)
    for i, ids in enumerate(random_prompts(4, seed=7)):
        if i % 2:
            decoder = RecordingDecoder(target, drafter)
            out = decoder.generate(ids, 20, temperature=1.0, generator=g)
        else:
            truth = target_generate(target, ids, 20).tokens
            decoder = RecordingDecoder(target, drafter, truth, ids.numel(),
                                       lambda: int(torch.randint(1, B + 1, (1,), generator=g)))
            out = decoder.generate(ids, 20)
            assert out.tokens == truth and {0, B - 1} <= set(out.accepted_lengths)
        assert ids.numel() + len(out.tokens) > 2 * SLIDING["sliding_window"]  # the window drops K/V
        assert_drafts_are_the_training_forwards(decoder, ids, out.tokens)


# -- speculative sampling (docs/method.md section 6b) ------------------------------------------------------------------

def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observed `counts` against exact cell probabilities; cells expected below `min_expected` pooled."""
    counts, expected = counts.double().flatten(), probs.double().flatten() * counts.sum()
    assert abs(float(probs.sum()) - 1) < 1e-5
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert float(counts[expected == 0].sum()) == 0, "a sample fell where the target puts no mass"
    keep = exp > 0
    stat, df = float(((obs - exp)[keep] ** 2 / exp[keep]).sum()), int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampling_distribution_by_hand():
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()[None]
    torch.testing.assert_close(sampling_probs(logits, 1.0)[0], torch.tensor([0.5, 0.25, 0.15, 0.1]))
    squared = torch.tensor([0.25, 0.0625, 0.0225, 0.01])
    torch.testing.assert_close(sampling_probs(logits, 0.5)[0], squared / squared.sum())  # p^(1/T), renormalised
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_k=3)[0], torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9)
    # top-p keeps the smallest most likely set reaching p: 0.5 + 0.25 >= 0.7
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.7)[0], torch.tensor([2 / 3, 1 / 3, 0, 0]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.76)[0], torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9)
    # temperature first, then top-k, then top-p: squared mass [0.725, 0.181, ...] keeps one token at top_p 0.7
    torch.testing.assert_close(sampling_probs(logits, 0.5, top_k=3, top_p=0.7)[0], torch.tensor([1.0, 0, 0, 0]))
    for bad, name in ((dict(temperature=-1.0), "temperature"), (dict(temperature=1.0, top_p=0.0), "top_p"),
                      (dict(temperature=1.0, top_k=-2), "top_k"), (dict(temperature=0.0), "greedy")):
        with pytest.raises(ValueError, match=name):
            sampling_probs(logits, **bad)


def first_disagreement_probs(draft: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Target-only sampling of n tokens, by where it first leaves the draft: cell [j, t] = drafts 1..j followed,
    then token t (t != d_{j+1} unless all n-1 were followed). Written from the target's chain rule alone."""
    n, V = probs.shape
    cells = torch.zeros(n, V, dtype=torch.float64)
    followed = 1.0
    for j in range(n):
        cells[j] = followed * probs[j].double()
        if j < n - 1:
            cells[j, draft[j]] = 0.0  # following d_{j+1} is counted in later rows
            followed *= float(probs[j, draft[j]])
    return cells


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_verification_step_is_lossless_exactly(sampling):
    """One verification's emitted tokens (accepted drafts, then the residual or bonus sample) are distributed as the
    target's own samples; the expected accepted count is the mean of the sampled one."""
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(4, 7, generator=g)  # the target after each of 4 block tokens
    probs = sampling_probs(logits, **sampling)
    order = probs.argsort(-1, descending=True)
    draft = torch.stack([order[0, 0], order[1, 1], order[2, -1]])  # likely, less likely, and (top-k) impossible
    expected = first_disagreement_probs(draft, probs)
    counts, accepted = torch.zeros(4, 7), []
    for _ in range(4000):
        a, token, expected_a = verify_drafts(draft, logits, **sampling, generator=g)
        counts[a, token] += 1
        accepted.append(a)
    assert chi_square_p(counts, expected) > 1e-3
    mean_a = float(expected[1:].sum(-1) @ torch.arange(1.0, 4, dtype=torch.float64))
    assert expected_a == pytest.approx(mean_a, rel=1e-5)  # sum_k prod_{i<=k} P_i(d_i) = E[a]
    assert sum(accepted) / len(accepted) == pytest.approx(mean_a, abs=4 * 1.5 / len(accepted) ** 0.5)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_verification_with_sampled_drafts_emits_the_targets_tokens(sampling):
    """Drafts sampled from a general q (DFlash2's selector, section 10), verified with min(1, P/q) and the residual
    max(0, P - q): the token emitted at each position is P's, given the run reached it (accepting with P(d) alone,
    or a residual of P without d, fails it: checked once each)."""
    g = torch.Generator().manual_seed(1)
    logits = 2 * torch.randn(4, 7, generator=g)  # the target after each of 4 block tokens, whatever came before
    probs = sampling_probs(logits, **sampling)
    q = torch.softmax(2 * torch.randn(3, 7, generator=g), -1)  # the drafter's q for slots 1..3, far from P
    counts = torch.zeros(3, 7)
    for _ in range(6000):
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
        a, token, _ = verify_drafts(draft, logits, **sampling, generator=g, draft_probs=q)
        for j, t in enumerate([*draft[:a].tolist(), int(token)][:3]):
            counts[j, t] += 1
    reached = counts.sum(-1)
    assert reached[1] > 600  # position 2 is reached often enough to test; position 3 where it is too
    for j in range(3):
        if reached[j] > 300:
            assert chi_square_p(counts[j], probs[j]) > 1e-3, f"position {j + 1}"


class TableDecoder(SpeculativeDecoder):
    """Drafts a fixed continuation per block token (the real drafting path runs too): some drafts likely, some not."""

    def __init__(self, target_model, drafter, table: dict[int, list[int]]) -> None:
        super().__init__(target_model, drafter)
        self.table = table

    def draft(self, context, x, start, *sampling):
        super().draft(context, x, start, *sampling)
        return Draft(torch.tensor(self.table[int(x)], device=x.device))


@functools.cache
def sampling_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict[int, list[int]]]:
    """A target of V 5 tokens (about 1 nat per token), a prompt, the exact distribution of the L = 5 tokens it samples
    after it `[V^(L-1), V]`, and a table of drafts: its greedy continuation of prompt + x for every x."""
    V, L = 5, 5
    config = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(20)  # about 1 nat per token: neither uniform nor a point mass
    prompt = torch.tensor([1, 3, 2])
    # the exact distribution of L sampled tokens, from one forward over every (L-1)-token prefix
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=L - 1)))  # [V^(L-1), L-1]
    with torch.no_grad():
        logits = target(input_ids=torch.cat([prompt.expand(len(prefixes), -1), prefixes], 1)).logits
    probs = sampling_probs(logits[:, prompt.numel() - 1:].reshape(-1, V), 1.0).view(len(prefixes), L, V).double()
    rows = torch.arange(len(prefixes))
    exact = probs[:, -1] * probs[rows[:, None], torch.arange(L - 1), prefixes].prod(-1, keepdim=True)  # [V^(L-1), V]
    # drafts: the target's greedy continuation of prompt + x, right often at the first slots and less later
    table = {x: target_generate(target, torch.cat([prompt, torch.tensor([x])]), SAMPLED_BLOCK - 1).tokens
             for x in range(V)}
    return target, prompt, exact, table


SAMPLED_BLOCK = 4
"""Block size of the drafters of `check_sampling_is_lossless`."""


def check_sampling_is_lossless(drafter_kw: dict, table: bool = False, noise: bool = False) -> None:
    """The decoder's sequences at temperature 1 follow the target's exact sequence distribution (chi-square over
    all V^L sequences of `sampling_case`, rare ones pooled), for a drafter of `drafter_kw` (its parts' weights moved
    off their initialisation with `noise`, so that q spreads over the candidates) drafting its own drafts, held to
    the training forward's, or with `table` the table's drafts through the real drafting path."""
    target, prompt, exact, drafts = sampling_case()
    V, L, samples = target.config.vocab_size, 5, 400
    drafter = DFlashDrafter(DrafterConfig(num_layers=2 if "layer_types" in drafter_kw else 1, block_size=SAMPLED_BLOCK,
                                          mask_token_id=V - 1, gamma=4.0, **drafter_kw).resolved(target.config))
    if noise:
        for p in drafter.parameters():
            p.data += 0.3 * torch.randn_like(p)
        drafter.norm.weight.data *= 0.05  # the head is the target's, sharpened 20x above
    drafter.set_target_io(target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach())
    decoder = TableDecoder(target, drafter.eval(), drafts) if table else RecordingDecoder(target, drafter.eval())
    g = torch.Generator().manual_seed(0)
    counts, accepted = torch.zeros(V ** L), []
    for n in range(samples):
        out = decoder.generate(prompt, L, temperature=1.0, generator=g)
        assert len(out.tokens) == L
        if not table:
            if n < 40:  # a window of 3 drops K/V: the sequence is 8 long
                assert_drafts_are_the_training_forwards(decoder, prompt, out.tokens)
            decoder.steps.clear()
        counts[sum(t * V ** (L - 1 - i) for i, t in enumerate(out.tokens))] += 1
        accepted += out.accepted_lengths
    if table:
        assert min(accepted) == 0 and max(accepted) == SAMPLED_BLOCK - 1  # rejections, and steps that took the bonus
    assert chi_square_p(counts, exact.flatten()) > 1e-3


SAMPLING_TABLE = "tests/test_speculative.py::test_speculative_sampling_is_lossless[table]"


@pytest.mark.parametrize("drafting", ["table", pytest.param("sliding", marks=pytest.mark.pinned_only(
    same_path_as=SAMPLING_TABLE))])  # the target's calls as with the table; the sliding drafter is ours
def test_speculative_sampling_is_lossless(drafting):
    """Sampled decoding follows the target's exact sequence distribution (`check_sampling_is_lossless`); sampling
    the residual from P instead of P without d_k fails it (p < 1e-40 at these sizes, checked once by breaking the
    rule). `table`: drafts from a fixed table, likely and unlikely ones; `sliding`: a sliding-window drafter's own
    drafts (docs/method.md 3b), through the whole real path. Every preset's drafter, with its parts' draft
    distributions q where they sample, is held to it by tests/test_contract.py."""
    # two layers: with one, slots 1..B-1 never see the context that only slot 0's window reaches
    window = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 3} if drafting == "sliding" else {}
    check_sampling_is_lossless(window, table=drafting == "table")
