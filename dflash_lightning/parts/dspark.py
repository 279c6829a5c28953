"""DSpark's heads (docs/method.md section 12): a Markov head on the logits and a confidence head for adaptive
verification, on an anchor-first block (every slot k predicts p + k + 1: `ANCHOR_FIRST`, read by `blocks`' rules).

`z_k = head(h_k) + markov_w2(markov_w1[prev_k])`, `c_k = sigmoid(proj([h_k; markov_w1[prev_k]]))`. Training is
teacher-forced (prev_k the true token at p + k) inside the chunked head loop: 0.1 CE + 0.9 L1 to the target's
distribution + 1.0 BCE of c against 1 - TV, with hand-made gradients of the heads' weights; decoding feeds the
Markov head the drafted token, greedy or sampled from softmax(z / T).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric

from dflash_lightning.blocks import BlockLayout
from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.base import (
    ChunkResult,
    Draft,
    DraftInputs,
    HeadChunk,
    HeadOutput,
    Part,
    PartOutput,
    RunSettings,
    TrainInputs,
)

ECE_BINS = 10
"""Equal-width confidence bins of the expected calibration error (in training, and on served blocks)."""
ADAPTIVE_THRESHOLDS = (0.3, 0.5, 0.7, 0.9)
"""Survival thresholds of the served adaptive-verification report: a draft is verified while a_k = prod c_i is at or
above."""
ANCHOR_FIRST = BlockLayout(anchor_first=True, gamma=4.0)
"""Section 12's block: every slot k = 0..B-1 predicts p + k + 1 and drafts (B drafts a block); w_k = exp(-k / 4)
unless gamma is set (DeepSpec's loss_decay_gamma)."""


@dataclass
class DSparkSettings:
    """Shape and loss weights of DSpark's Markov and confidence heads (`model.drafter.dspark_heads.*`)."""

    markov_rank: int = 256
    """Rank r of the Markov head, Embedding(V, r) then Linear(r -> V) (config.json markov_rank)."""
    confidence_with_markov: bool = True
    """The confidence head reads [h_k; markov_w1[prev_k]] (true) or h_k alone (config.json
    confidence_head_with_markov)."""
    ce_weight: float = 0.1
    """Weight of the CE against the data tokens (a training choice, not exported)."""
    tv_weight: float = 0.9
    """Weight of the L1 distance ||Q_k - P_k||_1 to the target's distribution (= 2 TV; not exported)."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's BCE against 1 - TV (not exported)."""

    def check(self, config: Any) -> None:
        """Raise ConfigError naming the field of a value that cannot work for the drafter `config`."""
        if self.markov_rank < 1:
            raise ConfigError(f"dspark_heads.markov_rank must be >= 1, got {self.markov_rank}")
        for name in ("ce_weight", "tv_weight", "confidence_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"dspark_heads.{name} must be >= 0, got {getattr(self, name)}")
        if not (self.ce_weight or self.tv_weight):
            raise ConfigError("dspark_heads: ce_weight and tv_weight are both 0, so the drafter's tokens would never "
                              "train (only the confidence head would); set one above 0")


class MarkovHead(nn.Module):
    """The "vanilla" Markov head: a rank-r bigram term of the token before the slot added to its logits."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev: Tensor, dtype: torch.dtype) -> Tensor:
        """The logit term of each row's previous token `prev [N]`, in `dtype`.  # [N, V]"""
        return F.linear(self.markov_w1.weight[prev].to(dtype), self.markov_w2.weight.to(dtype))


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k; markov_w1[prev_k]])): P(draft k accepted | drafts before it accepted), fp32."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: Tensor, markov: Tensor | None) -> Tensor:
        """The logit of c of each row, fp32, from `hidden [N, H]` and `markov_w1[prev] [N, r]` (None: h alone).
        # [N]"""
        x = hidden.float() if markov is None else torch.cat([hidden.float(), markov.float()], -1)
        return F.linear(x, self.proj.weight.float(), self.proj.bias.float())[:, 0]


class DSparkHeads(Part):
    """DSpark's Markov and confidence heads, placed as the engines name them (`markov_head.*`,
    `confidence_head.*`), on section 12's anchor-first block."""

    name = "dspark_heads"
    settings_type = DSparkSettings
    metric_prefix = "dspark"
    config_fields: ClassVar[dict[str, str]] = {}
    """DSpark's fields live at config.json's top level (`top_level_fields`), where vLLM reads markov_rank."""
    weight_prefix = None
    layout = ANCHOR_FIRST
    # fp8_exempt stays false: the heads' weights are only ever read by hand (F.linear on `.weight`), never through
    # their modules' forward, so an FP8 training linear in their place computes nothing differently.
    needs_final_hidden = True
    decodes = True
    head_rows = 1

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        r = self.settings.markov_rank
        self.hidden_size = config.hidden_size
        self.markov_head = MarkovHead(config.vocab_size, r)
        self.confidence_head = ConfidenceHead(config.hidden_size, r if self.settings.confidence_with_markov else 0)
        self.reset_parameters()

    def attach(self, drafter: nn.Module) -> None:
        in_loop = [type(p).__name__ for p in drafter.parts
                   if p is not self and type(p).head_chunk is not Part.head_chunk]
        if in_loop:  # head_chunk takes the loop's finished dz to the Markov weights: nothing may add to it after
            raise ValueError(f"DSpark's heads cannot share the head loop with {', '.join(in_loop)}")
        drafter.add_module("markov_head", self.markov_head)
        drafter.add_module("confidence_head", self.confidence_head)

    @classmethod
    def owns(cls, key: str) -> bool:
        return key.startswith(("markov_head.", "confidence_head."))

    @classmethod
    def check_run(cls, settings: DSparkSettings, run: RunSettings) -> None:
        """Section 12's loss is its own: the heads' L1 to the target's distribution (no distillation objective
        beside it) over exp(-k / gamma) slot weights (no D-PACE)."""
        if run.objective != "ce" or run.loss_weights != "decay":
            raise ConfigError(f"model.objective={run.objective}, model.loss_weights={run.loss_weights}: DSpark's heads "
                              f"(model.drafter.dspark_heads) train with section 12's loss: set model.objective=ce and "
                              f"model.loss_weights=decay")

    def reset_parameters(self, std: float = 0.02) -> None:
        """DeepSpec's init: normal(0, 0.02) weights, a zero bias."""
        markov = self.markov_head
        for w in (markov.markov_w1.weight, markov.markov_w2.weight, self.confidence_head.proj.weight):
            nn.init.normal_(w, std=std)
        nn.init.zeros_(self.confidence_head.proj.bias)

    def _markov_rows(self, prev: Tensor) -> Tensor | None:
        """markov_w1[prev] where the confidence head reads it, else None.  # [N, r]"""
        return self.markov_head.markov_w1.weight[prev] if self.settings.confidence_with_markov else None

    # --- training: inside the head loop, teacher-forced, with hand-made gradients of the heads' weights
    def objective_weight(self) -> float:
        return self.settings.ce_weight

    def head_params(self) -> tuple[Tensor, ...]:
        return (self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight, self.confidence_head.proj.weight,
                self.confidence_head.proj.bias)

    def head_inputs(self, batch: TrainInputs) -> tuple[Tensor, ...]:
        """Per row: prev, the true token before the slot's label (slot 0: the anchor's), and the target's final
        hidden state that predicts the label (the teacher of the L1 term)."""
        before = batch.before[:, batch.first_slot:].flatten()  # [N]
        return batch.input_ids[before], batch.final_hidden[before]

    def logit_bias(self, rows: tuple[Tensor, ...], like: Tensor) -> Tensor:
        return self.markov_head(rows[0], like.dtype)

    def head_chunk(self, chunk: HeadChunk) -> ChunkResult:
        """The L1 and BCE terms over one chunk of rows whose `logits` are already z (the Markov term added).

        Adds tv_weight * d||Q - P||_1/dz into `d_logits` (the loop's 0.1 CE is already there), then, this being the
        preset's only part in the loop, takes the finished weighted dz to the Markov weights; the confidence's
        BCE gradient goes to `proj`, markov_w1 and (`grad_hidden`) the rows' hidden states. Rows out: per row
        (1 - TV, z's argmax right, c) `[R, 3]`.
        """
        s, w, labels = self.settings, chunk.weights, chunk.labels
        prev, teacher = chunk.rows
        w1, w2, proj_w, _ = self.head_params()
        grad_w1, grad_w2, grad_proj_w, grad_proj_b = chunk.grads
        with torch.autocast(chunk.logits.device.type, enabled=False):
            dt = chunk.logits.dtype  # fp32 (fp64 in the tests)
            # two [R, V] buffers beside the loop's own, worked in place: P_k, then Q - P, its sign, then d l1 / dz
            q = torch.exp(chunk.logits - chunk.lse)  # [R, V] the drafter's Q_k
            work = torch.softmax(F.linear(teacher.to(chunk.head.dtype), chunk.head).to(dt), -1)  # [R, V] target's P_k
            work.sub_(q).neg_()  # Q - P
            l1 = work.abs().sum(-1)  # [R] = 2 TV
            work.sign_()
            work.sub_((work * q).sum(-1, keepdim=True)).mul_(q)  # d l1 / dz = q * (sign - sum(sign * q))
            chunk.d_logits.add_(work, alpha=s.tv_weight)
            del work, q
            markov = self._markov_rows(prev)
            logit = self.confidence_head(chunk.hidden.to(dt), markov).to(dt)  # [R]
            accept = 1 - l1 / 2  # BCE target, no gradient
            bce = F.softplus(logit) - accept * logit  # BCE with logits
            d_logit = s.confidence_weight * w * (torch.sigmoid(logit) - accept)  # [R], weighted
            x = chunk.hidden.to(dt) if markov is None else torch.cat([chunk.hidden.to(dt), markov.to(dt)], -1)
            grad_proj_w.add_(d_logit[None] @ x)
            grad_proj_b.add_(d_logit.sum().reshape(1))
            weight = proj_w.to(dt)[0]
            grad_hidden = d_logit[:, None] * weight[: self.hidden_size]  # [R, H]
            dz = chunk.d_logits * w[:, None]  # the finished d loss / dz of the rows (weighted)  # [R, V]
            e = w1[prev].to(dt)  # [R, r]
            grad_w2.add_(dz.T @ e)
            d_e = dz @ w2.to(dt)  # [R, r]
            if markov is not None:
                d_e = d_e + d_logit[:, None] * weight[self.hidden_size:]
            grad_w1.index_add_(0, prev, d_e)
            right = (chunk.logits.argmax(-1) == labels).to(dt)
            loss = s.tv_weight * (w * l1).sum() + s.confidence_weight * (w * bce).sum()
            return ChunkResult(loss=loss, logged=(w * l1).sum(), grad_hidden=grad_hidden,
                               rows=(torch.stack([accept, right, torch.sigmoid(logit)], -1),))

    def loss(self, batch: TrainInputs, head: HeadOutput | None, settings: Any) -> PartOutput:
        rows = head.rows[0].unflatten(0, (batch.labels.shape[0], -1))  # [A, B, 3] (every slot drafts)
        m = batch.supervised
        n = m.sum().clamp_min(1)
        accept, conf = rows[..., 0], rows[..., 2]
        eps = 1e-6
        bce = -(accept * conf.clamp_min(eps).log() + (1 - accept) * (1 - conf).clamp_min(eps).log())
        return PartOutput(logs={"dspark/l1": head.logged, "dspark/accept": (accept * m).sum() / n,
                                "dspark/confidence_bce": (bce * m).sum() / n}, rows=rows)

    @classmethod
    def metric(cls, block_size: int) -> Metric:
        return DSparkMetrics(block_size)

    # --- decoding
    @torch.no_grad()
    def draft(self, inputs: DraftInputs) -> Draft:
        """Drafts of the block's slots in order, the Markov head fed the token drafted at the slot before (slot 0:
        x): greedy argmax z_k, or sampled from q_k = softmax(z_k / T) (returned, `[n, V]`); extras
        `{"confidence": c_k}` of every slot along the drafts `[n]`."""
        hidden, logits, temperature = inputs.hidden, inputs.logits, inputs.temperature
        n = hidden.shape[0]
        prev, picks = inputs.first_prev.reshape(1), []
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device) if temperature else None
        conf = []
        for k in range(n):
            z = logits[k].float() + self.markov_head(prev, torch.float32)[0]  # [V]
            markov = self._markov_rows(prev)
            conf.append(torch.sigmoid(self.confidence_head(hidden[k : k + 1], markov)))
            if temperature:
                q[k] = torch.softmax(z / temperature, -1)
                prev = torch.multinomial(q[k], 1, generator=inputs.generator)
            else:
                prev = z.argmax().reshape(1)
            picks.append(prev)
        return Draft(torch.cat(picks), q, {"confidence": torch.cat(conf)})

    # --- the served report (evaluate)
    @classmethod
    def served_report(cls, records: list[dict[str, Any]]) -> dict[str, Any]:
        """`adaptive_verification`: what an engine's adaptive verification would make of the served confidences,
        and their calibration (`adaptive_verification`); none where no step recorded confidences."""
        if not served_steps(records):
            return {}
        return {"adaptive_verification": adaptive_verification(records)}

    # --- export and import: config.json's top level (section 12)
    @classmethod
    def top_level_fields(cls, settings: DSparkSettings, config: Any = None) -> dict[str, Any]:
        """All written: the engines read the MASK id and layer ids here too, vLLM reads markov_rank only here and
        builds the confidence head only with enable_confidence_head; SGLang requires markov_head_type; the
        engines' defaults of confidence_head_with_markov disagree (vLLM false, SGLang true); and the block layout,
        which vLLM and SGLang read as anchor-first when missing and llama.cpp as fill-in, is always stated."""
        return {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                "sample_from_anchor": True, "markov_rank": settings.markov_rank, "markov_head_type": "vanilla",
                "enable_confidence_head": True, "confidence_head_with_markov": settings.confidence_with_markov}

    @classmethod
    def present_fields(cls, dflash: dict[str, Any]) -> list[str]:
        return [key for key in ("markov_rank", "markov_head_type") if dflash.get(key) is not None]

    @classmethod
    def read_fields(cls, dflash: dict[str, Any], source: str) -> DSparkSettings:
        """The heads' settings from a folder's fields (dflash_config's, else config.json's top level); a head this
        package does not train (gated or rnn Markov heads, no confidence head) is refused by field."""
        rank, kind = dflash.get("markov_rank"), dflash.get("markov_head_type")
        if type(rank) is not int or rank < 1:
            raise ConfigError(f"{source}: markov_rank must be an integer >= 1, got {rank!r}")
        if kind != "vanilla":
            raise ConfigError(f"{source}: markov_head_type {kind!r}: only 'vanilla' Markov heads are trained here")
        if dflash.get("enable_confidence_head") is not True:
            raise ConfigError(f"{source}: enable_confidence_head must be true (a DSpark drafter here has a "
                              f"confidence head), got {dflash.get('enable_confidence_head')!r}")
        with_markov = dflash.get("confidence_head_with_markov")
        if type(with_markov) is not bool:
            raise ConfigError(f"{source}: confidence_head_with_markov must be true or false (vLLM reads a missing "
                              f"one as false, SGLang as true), got {with_markov!r}")
        return DSparkSettings(markov_rank=rank, confidence_with_markov=with_markov)


class DSparkMetrics(Metric):
    """Per slot 1 - TV(Q, P) and the tau it implies, the greedy accepted prefix (teacher-forced prev equals the
    drafted token along a correct prefix), and the confidence's calibration against 1 - TV: ECE per slot, Brier,
    and the bias of the survival product a_k = prod c_i against prod (1 - TV_i)."""

    full_state_update = False

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_size = block_size
        for name in ("slots", "accept", "brier", "survival_bias"):
            self.add_state(name, torch.zeros(block_size), dist_reduce_fx="sum")  # [B]
        for name in ("bin_count", "bin_conf", "bin_accept"):
            self.add_state(name, torch.zeros(block_size, ECE_BINS), dist_reduce_fx="sum")  # [B, bins]
        self.add_state("accepted", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("blocks", torch.zeros(()), dist_reduce_fx="sum")

    def update(self, rows: Tensor, labels: Tensor, supervised: Tensor) -> None:
        """`rows [A, B, 3]`: per slot (1 - TV, argmax right, c); `supervised [A, B]` (a prefix of each block)."""
        m = supervised.float()
        accept, right, conf = rows[..., 0].float(), rows[..., 1].float(), rows[..., 2].float()
        self.slots += m.sum(0)
        self.accept += (accept * m).sum(0)
        self.brier += ((conf - accept) ** 2 * m).sum(0)
        self.survival_bias += ((conf.cumprod(-1) - accept.cumprod(-1)) * m).sum(0)
        bins = (conf * ECE_BINS).long().clamp(0, ECE_BINS - 1)  # [A, B]
        one_hot = F.one_hot(bins, ECE_BINS).float() * m[..., None]  # [A, B, bins]
        self.bin_count += one_hot.sum(0)
        self.bin_conf += (one_hot * conf[..., None]).sum(0)
        self.bin_accept += (one_hot * accept[..., None]).sum(0)
        valid_block = m[:, 0]
        self.accepted += ((right * m).cumprod(-1).sum(-1) * valid_block).sum()
        self.blocks += valid_block.sum()

    def compute(self) -> dict[str, Tensor]:
        slots = self.slots.clamp_min(1)
        accept = self.accept / slots  # [B]
        ece = (self.bin_conf - self.bin_accept).abs().sum(-1) / slots  # [B]
        out = {"dspark/accept": accept.mean(), "dspark/tau_tv": 1 + accept.cumprod(0).sum(),
               "dspark/tau_greedy": 1 + self.accepted / self.blocks.clamp_min(1), "dspark/ece": ece.mean(),
               "dspark/brier": (self.brier / slots).mean(), "dspark/survival_bias": (self.survival_bias / slots).mean()}
        for k in range(self.block_size):
            out[f"dspark/accept/slot_{k:02d}"] = accept[k]
            out[f"dspark/ece/slot_{k:02d}"] = ece[k]
        return out


def served_steps(records: list[dict[str, Any]]) -> list[tuple[int, list[float]]]:
    """(accepted drafts a, c_k of the block's drafts) of every served step with confidences (`Draft.extras`,
    recorded per step by `Generation.extras`), over the records of `evaluate`."""
    return [(a, c) for r in records if "confidence" in r["extras"]
            for a, c in zip(r["accepted_lengths"], r["extras"]["confidence"], strict=True)]


def adaptive_verification(records: list[dict[str, Any]], thresholds: Sequence[float] = ADAPTIVE_THRESHOLDS
                          ) -> dict[str, Any]:
    """What verifying only the drafts a confidence head admits would do (docs/method.md 12), from the served steps.

    For each step with confidences c_k and a accepted drafts: at threshold t the engine verifies the prefix whose
    survival a_k = prod_{i<=k} c_i >= t (n_t drafts) and accepts min(a, n_t) of them. Per threshold: drafts
    verified and accepted per step, the tau it implies (1 + accepted per step) and the share of verified drafts
    accepted, beside verifying all; and the confidences' calibration on the served blocks (`served_calibration`).
    """
    steps = served_steps(records)
    n = len(steps)
    survival = [list(itertools.accumulate(c, lambda x, y: x * y)) for _, c in steps]
    out: dict[str, Any] = {"steps": n, "all": {
        "verified_per_step": sum(len(c) for _, c in steps) / n, "accepted_per_step": sum(a for a, _ in steps) / n}}
    for t in thresholds:
        admitted = [sum(1 for s in surv if s >= t) for surv in survival]  # survival only falls: a prefix
        verified, kept = sum(admitted), sum(min(a, m) for (a, _), m in zip(steps, admitted, strict=True))
        out[f"threshold_{t:g}"] = {"verified_per_step": verified / n, "accepted_per_step": kept / n,
                                   "tau": 1 + kept / n, "accepted_share": kept / verified if verified else None}
    out["calibration"] = served_calibration(steps)
    return out


def served_calibration(steps: list[tuple[int, list[float]]]) -> dict[str, Any]:
    """The confidences' calibration on served blocks, from (accepted drafts a, c_k) of each step: draft k is reached
    when the k drafts before it were accepted; c_k against its acceptance there (ECE per slot and pooled, Brier),
    and a_k against the acceptance of the whole prefix to k at every step (Brier, bias = mean a_k - acceptance
    rate): what the engines' per-slot temperature scaling (SGLang's --speculative-dspark-confidence-sts-path) would
    correct."""
    survival = [list(itertools.accumulate(c, lambda x, y: x * y)) for _, c in steps]
    width = max(len(c) for _, c in steps)
    reached = [[(c[k], float(a > k)) for a, c in steps if k <= a and k < len(c)] for k in range(width)]
    ece = [served_ece(pairs) for pairs in reached]
    pooled = [p for pairs in reached for p in pairs]
    prefix = [(surv[k], float(a > k)) for (a, _), surv in zip(steps, survival, strict=True) for k in range(len(surv))]
    return {
        "ece": served_ece(pooled), "ece_per_slot": ece, "reached_per_slot": [len(p) for p in reached],
        "brier": sum((c - y) ** 2 for c, y in pooled) / len(pooled),
        "survival_brier": sum((s - y) ** 2 for s, y in prefix) / len(prefix),
        "survival_bias": sum(s - y for s, y in prefix) / len(prefix),
    }


def served_ece(pairs: list[tuple[float, float]]) -> float | None:
    """Expected calibration error of (confidence, outcome) pairs in `ECE_BINS` equal-width bins, as `DSparkMetrics`
    bins them in training; None without pairs."""
    if not pairs:
        return None
    bins: dict[int, list[tuple[float, float]]] = {}
    for c, y in pairs:
        bins.setdefault(min(int(c * ECE_BINS), ECE_BINS - 1), []).append((c, y))
    return sum(abs(sum(c for c, _ in b) - sum(y for _, y in b)) for b in bins.values()) / len(pairs)


__all__ = ["ADAPTIVE_THRESHOLDS", "ConfidenceHead", "DSparkHeads", "DSparkMetrics", "DSparkSettings", "MarkovHead",
           "adaptive_verification", "served_calibration", "served_ece", "served_steps"]
