"""DSpark's heads (docs/method.md section 12): a Markov head on the logits and a confidence head for adaptive
verification, on an anchor-first block (every slot k predicts p + k + 1: `ANCHOR_FIRST`, read by `blocks`' rules).

`z_k = head(h_k) + markov_w2(markov_w1[prev_k])`, `c_k = sigmoid(proj([h_k; markov_w1[prev_k]]))`. Training is
teacher-forced (prev_k the true token at p + k) inside the chunked head loop: 0.1 CE + 0.9 L1 to the target's
distribution + 1.0 BCE of c against 1 - TV, with hand-made gradients of the heads' weights; decoding feeds the
Markov head the drafted token, greedy or sampled from softmax(z / T). On served blocks (docs/dspark.md): the
paper's survival measures, the engines' adaptive verification simulated, and the calibration `calibrate` fits
(SGLang's per-slot temperatures, an affine map export folds into `confidence_head.proj` for vLLM).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric

from dflash_lightning.blocks import BlockLayout
from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.base import (
    Calibration,
    ChunkResult,
    Draft,
    DraftInputs,
    HeadChunk,
    HeadOutput,
    Part,
    PartOutput,
    ServedSettings,
    TrainInputs,
    VerifyCost,
)

ECE_BINS = 10
"""Equal-width confidence bins of the ECE of c_k: in training (against 1 - TV), and on served blocks against the
acceptance of the drafts reached (`served_calibration`)."""
SURVIVAL_BINS = 20
"""Equal-width bins of the ECE of the survival a_k against the prefix's acceptance, as DeepSpec's evaluator and the
paper count it (`survival_calibration`)."""
ENGINE_LAGS = {"vllm": 1, "sglang": 2}
"""How many steps old the confidences are that each engine sizes the verified prefix by: vLLM 0.34 reads the copy of
the previous step's (adaptive_verification.py), SGLang 0.5.23 those of two steps back (dspark_planner.py,
SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS 2)."""
ENGINE_FLOORS = {"vllm": 0.0, "sglang": 1e-6}
"""Survivals below which an engine never admits a draft (SGLang's DSparkScheduleConfig.survival_eps)."""
STS_GRID = tuple(math.exp(math.log(0.05) + i * (math.log(20.0) - math.log(0.05)) / 240) for i in range(241))
"""Candidate per-slot temperatures of the sequential temperature scaling (0.05 to 20, geometric)."""
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
    # Section 12's loss is its own: the heads' L1 to the target's distribution (no distillation objective beside
    # it) over exp(-k / gamma) slot weights (no D-PACE).
    own_loss = "DSpark's heads (model.drafter.dspark_heads) train with section 12's loss"
    alone_in_loop = "takes the loop's finished dz to the Markov weights: nothing may add to it after"
    decodes = True
    opd_refusal = ("drafts slot k from logits that read the token drafted at slot k-1 (the Markov head): the "
                   "stage would have to roll that chain out and train it on the draft's own tokens, which is not "
                   "built")
    head_rows = 1

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        r = self.settings.markov_rank
        self.hidden_size = config.hidden_size
        self.markov_head = MarkovHead(config.vocab_size, r)
        self.confidence_head = ConfidenceHead(config.hidden_size, r if self.settings.confidence_with_markov else 0)
        self.reset_parameters()

    def attach(self, drafter: nn.Module) -> None:
        drafter.add_module("markov_head", self.markov_head)
        drafter.add_module("confidence_head", self.confidence_head)

    @classmethod
    def owns(cls, key: str) -> bool:
        return key.startswith(("markov_head.", "confidence_head."))

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
        `{"confidence": c_k, "confidence_logit": proj(...)}` of every slot along the drafts `[n]` (the logit is what
        a calibration maps: c near 1 loses it in fp32)."""
        hidden, logits, temperature = inputs.hidden, inputs.logits, inputs.temperature
        n = hidden.shape[0]
        prev, picks = inputs.first_prev.reshape(1), []
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device) if temperature else None
        conf = []
        for k in range(n):
            z = logits[k].float() + self.markov_head(prev, torch.float32)[0]  # [V]
            markov = self._markov_rows(prev)
            conf.append(self.confidence_head(hidden[k : k + 1], markov))
            if temperature:
                q[k] = torch.softmax(z / temperature, -1)
                prev = torch.multinomial(q[k], 1, generator=inputs.generator)
            else:
                prev = z.argmax().reshape(1)
            picks.append(prev)
        logit = torch.cat(conf)  # [n]
        return Draft(torch.cat(picks), q, {"confidence": torch.sigmoid(logit), "confidence_logit": logit})

    # --- the served report (evaluate) and the calibration (calibrate, export)
    @classmethod
    def served_report(cls, records: list[dict[str, Any]], settings: ServedSettings | None = None) -> dict[str, Any]:
        """What the engines' adaptive verification makes of the served confidences (`adaptive_verification`) and
        their calibration (`confidence_calibration`), raw and, where `settings` carry this temperature's
        calibration, with SGLang's per-slot temperatures and with the affine map folded for vLLM; none where no
        step recorded confidences."""
        settings = settings or ServedSettings()
        prompts = served_blocks(records)
        if not any(prompts):
            return {}
        fit = (settings.calibration or {}).get(cls.name)
        views = confidence_views(fit)
        steps = [s for p in prompts for s in p]
        engines = {"vllm": views["affine" if fit else "raw"], "sglang": views["sts" if fit else "raw"]}
        return {"adaptive_verification": adaptive_verification(prompts, settings.cost, engines),
                "confidence_calibration": {
                    "survival": {name: survival_calibration(steps, view) for name, view in views.items()},
                    "reached": served_calibration([(s.accepted, view_of(s, views["raw"])) for s in steps])}}

    @classmethod
    def calibrate(cls, records: list[dict[str, Any]], state: dict[str, Tensor]) -> Calibration:
        """Fit, on the served blocks of one temperature, SGLang's per-slot temperatures (sequential temperature
        scaling: T_k left to right, each minimising the survival ECE at slot k given T_<k) and an affine map
        `c = sigmoid(scale * logit + shift)` minimising the survival's cross-entropy over every verified slot, which
        `fold_calibration` folds into `confidence_head.proj` for vLLM (it uses the raw sigmoid)."""
        steps = [s for p in served_blocks(records) for s in p]
        if not steps:
            raise ConfigError("calibrate: no served step recorded DSpark's confidences")
        drafts = len(steps[0].logits)
        temperatures = fit_sts(steps, drafts)
        scale, shift = fit_affine(steps)
        if not (math.isfinite(scale) and math.isfinite(shift)):  # every draft accepted, or none: nothing to rank
            raise ConfigError(f"calibrate: the affine map does not converge on {len(steps)} served blocks (scale "
                              f"{scale}, shift {shift}); serve more prompts")
        fit = {"drafts": drafts, "sts_temperatures": temperatures, "affine": {"scale": scale, "shift": shift},
               "head": head_fingerprint(state)}
        views = confidence_views(fit)
        report = {"steps": len(steps), "verified_drafts": sum(s.verified for s in steps),
                  "survival": {name: survival_calibration(steps, view) for name, view in views.items()}}
        per_slot = {name: [p["ece"] for p in report["survival"][name]["per_position"]] for name in ("raw", "sts")}
        sts = {"temperatures": temperatures, "dataset": "dflash_lightning calibrate", "num_samples": len(steps)}
        if None not in per_slot["raw"] + per_slot["sts"]:  # SGLang reads these as lists of numbers
            sts |= {"ece_before": per_slot["raw"], "ece_after": per_slot["sts"]}
        survival = report["survival"]
        lines = [f"{len(steps)} served blocks: survival ECE raw {survival['raw']['ece']:.4f}, per-slot temperatures "
                 f"{survival['sts']['ece']:.4f}, affine {survival['affine']['ece']:.4f} (AUROC raw "
                 f"{_fmt(survival['raw']['auroc'])}, affine {_fmt(survival['affine']['auroc'])}); affine map: "
                 f"logit * {scale:.4f} {shift:+.4f}",
                 "SGLang: the sts file (--speculative-dspark-confidence-sts-path) is for the folder exported without "
                 "--calibration; a folder with the affine map folded in is served calibrated by both engines as it is"]
        return Calibration(fit, report, {"sts.json": json.dumps(sts) + "\n"}, lines)

    @classmethod
    def fold_calibration(cls, state: dict[str, Tensor], fit: dict[str, Any], source: str) -> dict[str, Tensor]:
        """`confidence_head.proj` with the affine map folded in: weight * scale, bias * scale + shift (fp64, then
        the weights' dtype), so vLLM's raw sigmoid gives the calibrated c; refused for a head other than the one
        calibrated (another drafter, or a calibration already folded)."""
        try:
            scale, shift = float(fit["affine"]["scale"]), float(fit["affine"]["shift"])
            head = fit["head"]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{source}: not a DSpark calibration (affine.scale, affine.shift, head)") from None
        ours = head_fingerprint(state)
        if any(not math.isclose(ours[k], head[k], rel_tol=2e-2, abs_tol=1e-3) for k in ours):
            raise ConfigError(f"{source}: calibrated for a confidence head of {head}, this drafter's is {ours} "
                              f"(another drafter, or one with a calibration already folded in): calibrate this one")
        w, b = state["confidence_head.proj.weight"], state["confidence_head.proj.bias"]
        return {**state, "confidence_head.proj.weight": (w.double() * scale).to(w.dtype),
                "confidence_head.proj.bias": (b.double() * scale + shift).to(b.dtype)}

    # --- export and import: config.json's top level (section 12)
    @classmethod
    def speculative_config(cls, settings: DSparkSettings) -> dict[str, Any]:
        """vLLM verifies the prefix the confidences make worth it (its adaptive verification, DSpark only)."""
        return {"enable_adaptive_verification": True}

    @classmethod
    def serve_notes(cls, settings: DSparkSettings) -> list[str]:
        """vLLM 0.32-0.34 draft argmax unless told (`draft_sample_method`, default "greedy"); `evaluate` at T > 0
        samples DSpark's drafts from q (SGLang's DSpark runtime has a draft sampler)."""
        return ['sampled serving: `evaluate` at temperature > 0 samples the drafts from q; vLLM drafts the argmax '
                'unless the --speculative-config adds "draft_sample_method": "probabilistic"']

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
    """Per slot 1 - TV(Q, P); tau as DeepSpec computes it (`dspark/tau`: the mean over blocks of 1 + sum_k
    prod_{i<=k} (1 - TV_i) over the block's supervised prefix) and the product of the per-slot means
    (`dspark/tau_tv`, which ignores how the slots of a block go together); the greedy accepted prefix
    (teacher-forced prev equals the drafted token along a correct prefix); and the confidence's calibration against
    1 - TV: ECE per slot, Brier, and the bias of the survival product a_k = prod c_i against prod (1 - TV_i)."""

    full_state_update = False

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_size = block_size
        for name in ("slots", "accept", "brier", "survival_bias"):
            self.add_state(name, torch.zeros(block_size), dist_reduce_fx="sum")  # [B]
        for name in ("bin_count", "bin_conf", "bin_accept"):
            self.add_state(name, torch.zeros(block_size, ECE_BINS), dist_reduce_fx="sum")  # [B, bins]
        self.add_state("accepted", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("expected", torch.zeros(()), dist_reduce_fx="sum")
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
        self.expected += ((accept * m).cumprod(-1).sum(-1) * valid_block).sum()
        self.blocks += valid_block.sum()

    def compute(self) -> dict[str, Tensor]:
        slots = self.slots.clamp_min(1)
        accept = self.accept / slots  # [B]
        ece = (self.bin_conf - self.bin_accept).abs().sum(-1) / slots  # [B]
        blocks = self.blocks.clamp_min(1)
        out = {"dspark/accept": accept.mean(), "dspark/tau": 1 + self.expected / blocks,
               "dspark/tau_tv": 1 + accept.cumprod(0).sum(),
               "dspark/tau_greedy": 1 + self.accepted / blocks, "dspark/ece": ece.mean(),
               "dspark/brier": (self.brier / slots).mean(), "dspark/survival_bias": (self.survival_bias / slots).mean()}
        for k in range(self.block_size):
            out[f"dspark/accept/slot_{k:02d}"] = accept[k]
            out[f"dspark/ece/slot_{k:02d}"] = ece[k]
        return out


@dataclass(frozen=True)
class ServedStep:
    """One served step of a DSpark drafter: its B drafts' confidence logits and what verification made of them."""

    logits: tuple[float, ...]
    """The confidence head's logit of each draft, in slot order (c_k = sigmoid of it)."""
    accepted: int
    """Drafts accepted (a): the prefix 0..a-1."""
    verified: int
    """Drafts verified: all B but where the length limit cut the last step short."""


def served_blocks(records: list[dict[str, Any]]) -> list[list[ServedStep]]:
    """The served steps of each prompt, in order, from `evaluate`'s records (`Draft.extras` recorded per step by
    `Generation.extras`); a record without confidences gives none. Records written before the logits were recorded
    give them back from c."""
    prompts = []
    for r in records:
        extras = r.get("extras") or {}
        logits = extras.get("confidence_logit") or [[_logit(c) for c in cs] for cs in extras.get("confidence", [])]
        verified = r.get("verified_lengths") or [len(ls) for ls in logits]
        prompts.append([ServedStep(tuple(ls), a, v) for ls, a, v in
                        zip(logits, r["accepted_lengths"], verified, strict=True)] if logits else [])
    return prompts


Confidence = Callable[[int, float], float]
"""c of slot k from its confidence logit: raw, or under a calibration."""


def confidence_views(fit: dict[str, Any] | None) -> dict[str, Confidence]:
    """The confidences the report compares: raw (what the head computes), and with a calibration `fit` SGLang's
    per-slot temperatures (`sts`, c_k = sigmoid(logit / T_k)) and the affine map vLLM serves folded (`affine`)."""
    views: dict[str, Confidence] = {"raw": lambda k, x: _sigmoid(x)}
    if fit:
        t, (scale, shift) = fit["sts_temperatures"], (fit["affine"]["scale"], fit["affine"]["shift"])
        views["sts"] = lambda k, x: _sigmoid(x / t[k])
        views["affine"] = lambda k, x: _sigmoid(scale * x + shift)
    return views


def view_of(step: ServedStep, view: Confidence) -> list[float]:
    """c_k of every draft of a step under a view."""
    return [view(k, x) for k, x in enumerate(step.logits)]


def survival(confidence: Sequence[float]) -> list[float]:
    """a_k = prod_{i<=k} c_i of a block's confidences."""
    return list(itertools.accumulate(confidence, lambda x, y: x * y))


def adaptive_verification(prompts: list[list[ServedStep]], cost: VerifyCost,
                          engines: dict[str, Confidence] | None = None) -> dict[str, Any]:
    """What the engines' adaptive verification would verify and accept of the served blocks, beside verifying all.

    Their rule (vLLM 0.34 `AdaptiveVerificationManager.get_num_tokens`, SGLang 0.5.23
    `compute_verify_token_budget`), for one request: verify the n drafts of highest survival (a prefix, survival only
    falls) with n maximising (1 + the sum of the n highest survivals) / `cost.step(n)`, the survivals those of the
    confidences `ENGINE_LAGS` steps old (all ones before a prompt has that many: a new request's; SGLang admits none
    below `ENGINE_FLOORS`). The step then accepts min(a, n) of the a the full verification accepted: the blocks are
    the served ones, the count of each step is the rule's (a counterfactual: a shorter verification would change the
    context after it). `current`: the rule on the step's own confidences, what the lag costs. Per rule: drafts
    verified and accepted a step, tau (1 + accepted), the cost a step and the tokens per cost against verifying
    all's. `engines`: the confidences each engine serves (default raw)."""
    engines = engines or {}
    raw = confidence_views(None)["raw"]
    steps = sum(len(p) for p in prompts)

    def run(lag: int | None, view: Confidence, floor: float = 0.0) -> dict[str, Any]:
        verified = accepted = spent = 0.0
        for prompt in prompts:
            survivals = [survival(view_of(s, view)) for s in prompt]
            for t, step in enumerate(prompt):
                if lag is None:
                    n = step.verified
                else:
                    seen = survivals[t - lag] if t >= lag else [1.0] * len(step.logits)
                    n = best_prefix(sorted((a for a in seen[: step.verified] if a >= floor), reverse=True), cost)
                verified, accepted, spent = verified + n, accepted + min(step.accepted, n), spent + cost.step(n)
        return {"verified_per_step": verified / steps, "accepted_per_step": accepted / steps,
                "tau": 1 + accepted / steps, "cost_per_step": spent / steps,
                "tokens_per_cost": (steps + accepted) / spent}

    out: dict[str, Any] = {"steps": steps, "cost": {"draft": cost.draft, "per_token": cost.per_token},
                           "all": run(None, raw)}
    for name, lag in ENGINE_LAGS.items():
        view = engines.get(name, raw)
        out[name] = {"lag": lag, **run(lag, view, ENGINE_FLOORS[name])}
        out[name]["throughput_vs_all"] = out[name]["tokens_per_cost"] / out["all"]["tokens_per_cost"]
    out["current"] = {"lag": 0, **run(0, engines.get("vllm", raw))}
    out["current"]["throughput_vs_all"] = out["current"]["tokens_per_cost"] / out["all"]["tokens_per_cost"]
    return out


def best_prefix(scores: Sequence[float], cost: VerifyCost) -> int:
    """The n in 0..len(scores) maximising (1 + sum of the first n `scores`) / cost.step(n), the first on ties (numpy's
    argmax, as vLLM takes it)."""
    best, best_value, total = 0, 1.0 / cost.step(0), 1.0
    for n, score in enumerate(scores, 1):
        total += score
        value = total / cost.step(n)
        if value > best_value:
            best, best_value = n, value
    return best


def survival_calibration(steps: list[ServedStep], view: Confidence, bins: int = SURVIVAL_BINS) -> dict[str, Any]:
    """The paper's measures of a confidence on served blocks (DeepSpec's evaluator): at each position k, the
    survival a_k = prod_{i<=k} c_i against whether the whole prefix 0..k was accepted, over the steps that verified
    draft k; per position ECE (`bins` equal-width bins), AUROC and Brier, and their means weighted by the pairs at
    each position (`ece`, `auroc` over the positions where it is defined, `brier`), the mean survival and
    acceptance, and the tau the survivals predict (1 + sum_k a_k a step) against the served one."""
    width = max(len(s.logits) for s in steps)
    pairs: list[list[tuple[float, float]]] = [[] for _ in range(width)]
    predicted = 0.0
    for s in steps:
        surv = survival(view_of(s, view))
        predicted += sum(surv[: s.verified])
        for k in range(s.verified):
            pairs[k].append((surv[k], float(s.accepted > k)))
    per_position = []
    for ps in pairs:
        scores, labels = [p for p, _ in ps], [y for _, y in ps]
        per_position.append({"pairs": len(ps), "ece": served_ece(ps, bins), "auroc": auroc(scores, labels),
                             "brier": sum((p - y) ** 2 for p, y in ps) / len(ps) if ps else None,
                             "survival": sum(scores) / len(ps) if ps else None,
                             "accepted": sum(labels) / len(ps) if ps else None})

    def mean(key: str) -> float | None:
        rows = [(r["pairs"], r[key]) for r in per_position if r[key] is not None]
        total = sum(n for n, _ in rows)
        return sum(n * v for n, v in rows) / total if total else None

    return {"ece": mean("ece"), "auroc": mean("auroc"), "brier": mean("brier"), "survival": mean("survival"),
            "accepted": mean("accepted"), "predicted_tau": 1 + predicted / len(steps),
            "served_tau": 1 + sum(s.accepted for s in steps) / len(steps), "bins": bins,
            "per_position": per_position}


def served_calibration(steps: list[tuple[int, list[float]]]) -> dict[str, Any]:
    """The calibration of c_k itself on served blocks, from (accepted drafts a, c_k) of each step: draft k is reached
    when the k drafts before it were accepted; c_k against its acceptance there (ECE per slot and pooled, `ECE_BINS`
    bins as in training, Brier), and a_k against the acceptance of the whole prefix to k at every step (Brier,
    bias = mean a_k - acceptance rate)."""
    surv = [survival(c) for _, c in steps]
    width = max(len(c) for _, c in steps)
    reached = [[(c[k], float(a > k)) for a, c in steps if k <= a and k < len(c)] for k in range(width)]
    ece = [served_ece(pairs) for pairs in reached]
    pooled = [p for pairs in reached for p in pairs]
    prefix = [(s[k], float(a > k)) for (a, _), s in zip(steps, surv, strict=True) for k in range(len(s))]
    return {
        "ece": served_ece(pooled), "ece_per_slot": ece, "reached_per_slot": [len(p) for p in reached],
        "brier": sum((c - y) ** 2 for c, y in pooled) / len(pooled),
        "survival_brier": sum((s - y) ** 2 for s, y in prefix) / len(prefix),
        "survival_bias": sum(s - y for s, y in prefix) / len(prefix),
    }


def served_ece(pairs: list[tuple[float, float]], bins: int = ECE_BINS) -> float | None:
    """Expected calibration error of (confidence, outcome) pairs in `bins` equal-width bins (bin floor(p * bins),
    the last closed: as `DSparkMetrics` and DeepSpec's evaluator bin); None without pairs."""
    if not pairs:
        return None
    groups: dict[int, list[tuple[float, float]]] = {}
    for c, y in pairs:
        groups.setdefault(min(max(int(c * bins), 0), bins - 1), []).append((c, y))
    return sum(abs(sum(c for c, _ in b) - sum(y for _, y in b)) for b in groups.values()) / len(pairs)


def auroc(scores: Sequence[float], labels: Sequence[float]) -> float | None:
    """The probability that a positive's score ranks above a negative's, ties counting one half (Mann-Whitney U
    from average ranks); None without both classes. Exact (DeepSpec bins scores in 1000 for it)."""
    n_pos = sum(1 for y in labels if y)
    n_neg = len(labels) - n_pos
    if not n_pos or not n_neg:
        return None
    order = sorted(range(len(scores)), key=scores.__getitem__)
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for m in range(i, j + 1):
            ranks[order[m]] = (i + j) / 2 + 1  # the average rank of the tie group, 1-based
        i = j + 1
    rank_sum = sum(r for r, y in zip(ranks, labels, strict=True) if y)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def fit_sts(steps: list[ServedStep], drafts: int, bins: int = SURVIVAL_BINS) -> list[float]:
    """Per-slot temperatures fit left to right (the paper's sequential temperature scaling): T_k from `STS_GRID`
    minimising the survival ECE at slot k, the survival prod_{i<=k} sigmoid(logit_i / T_i) with T_<k as fitted; 1
    for a slot no step verified."""
    temperatures: list[float] = []
    logits = torch.tensor([s.logits for s in steps], dtype=torch.float64)  # [S, B]
    verified = torch.tensor([s.verified for s in steps])
    accepted = torch.tensor([s.accepted for s in steps])
    prefix = torch.zeros(len(steps), dtype=torch.float64)  # log of the survival before slot k  # [S]
    grid = torch.tensor(STS_GRID, dtype=torch.float64)
    for k in range(drafts):
        rows = verified > k
        if not rows.any():
            temperatures.append(1.0)
            continue
        y = (accepted[rows] > k).double()  # [n]
        surv = torch.exp(prefix[rows][None] + F.logsigmoid(logits[rows, k][None] / grid[:, None]))  # [grid, n]
        best = int(torch.argmin(_ece_rows(surv, y, bins)))
        temperatures.append(float(grid[best]))
        prefix = prefix + F.logsigmoid(logits[:, k] / grid[best])
    return temperatures


def fit_affine(steps: list[ServedStep]) -> tuple[float, float]:
    """(scale, shift) of c = sigmoid(scale * logit + shift), one for every slot (the head is one linear map, folded
    at export), minimising the cross-entropy of the survival a_k against the prefix's acceptance over every
    verified slot (L-BFGS from the identity, fp64)."""
    width = max(len(s.logits) for s in steps)
    logits = torch.tensor([s.logits for s in steps], dtype=torch.float64)  # [S, B]
    slot = torch.arange(width)
    mask = slot[None] < torch.tensor([s.verified for s in steps])[:, None]  # [S, B]
    y = (slot[None] < torch.tensor([s.accepted for s in steps])[:, None]).double()  # [S, B]
    params = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([params], lr=1.0, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-12,
                                  line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        log_a = F.logsigmoid(params[0] * logits + params[1]).cumsum(-1)  # log a_k  # [S, B]
        log_not = torch.log(-torch.expm1(log_a.clamp(max=-1e-12)))  # log(1 - a_k)
        loss = -((y * log_a + (1 - y) * log_not) * mask).sum() / mask.sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    scale, shift = params.detach().tolist()
    return scale, shift


def head_fingerprint(state: dict[str, Tensor]) -> dict[str, float]:
    """Two numbers that tell a confidence head apart (a calibration is of one head): the norm of proj's weight
    and its bias."""
    w, b = state["confidence_head.proj.weight"], state["confidence_head.proj.bias"]
    return {"weight_norm": float(w.double().norm()), "bias": float(b.double().sum())}


def _ece_rows(probs: Tensor, y: Tensor, bins: int) -> Tensor:
    """The ECE of every row of `probs [G, n]` against outcomes `y [n]`, binned as `served_ece`.  # [G]"""
    index = (probs * bins).long().clamp(0, bins - 1)  # [G, n]
    gap = torch.zeros(probs.shape[0], bins, dtype=probs.dtype).scatter_add_(1, index, probs - y[None])
    return gap.abs().sum(-1) / probs.shape[1]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _logit(c: float) -> float:
    c = min(max(c, 1e-12), 1 - 1e-12)
    return math.log(c / (1 - c))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


__all__ = ["ConfidenceHead", "DSparkHeads", "DSparkMetrics", "DSparkSettings", "MarkovHead", "ServedStep",
           "adaptive_verification", "auroc", "best_prefix", "confidence_views", "fit_affine", "fit_sts",
           "served_blocks", "served_calibration", "served_ece", "survival_calibration"]
