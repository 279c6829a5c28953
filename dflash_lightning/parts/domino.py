"""Domino (docs/method.md section 13): a GRU over the block's tokens whose state corrects each slot's logits, on
section 12's anchor-first block; the base-to-final loss curriculum; greedy drafting as SGLang 0.5.23 does it; the
fields of the folder SGLang loads.

Shapes: A blocks (anchors), B slots (slot k predicts position p + k + 1), n drafting slots (B - 1), R rows of the
chunked head loop (slots of whole blocks, flattened), H the drafter's width, G `gru_hidden_dim`, E `emb_dim`, V the
vocabulary. f_k = head(h_k) + embed_proj([h_k; s_k]) where slot k >= P, f_k = head(h_k) below; s_k is the GRU's
state after the tokens at p..p+k (the true tokens in training, x_p and the drafts in decoding).
"""

from __future__ import annotations

import math
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
    Correction,
    Draft,
    DraftInputs,
    HeadChunk,
    HeadOutput,
    Part,
    PartOutput,
    RunSettings,
    TrainInputs,
)

PROJECTOR_TYPE = "domino"
"""dflash_config.projector_type of a Domino folder (SGLang builds the GRU and the projector for this value only)."""
SGLANG_POOL = 2048
"""SGLang's default `--speculative-domino-candidate-pool-size`: the correction is scored on a block-shared pool of
the base logits' top 2048 (0: the full vocabulary, the training semantics)."""
FOLDER_DTYPE = "bfloat16"
"""SGLang 0.5.23 serves Domino only with bf16 projector weights and a bf16 target; its runtime refuses others."""


@dataclass
class DominoSettings:
    """Domino's GRU and projector shapes, its loss curriculum and its drafting pool (`model.drafter.domino.*`)."""

    gru_hidden_dim: int = 1024
    """G: width of the prefix GRU's state (dflash_config.gru_hidden_dim)."""
    emb_dim: int = 256
    """E: width of the projector's bottleneck, Linear(H + G -> E), SiLU, Linear(E -> V) (dflash_config.emb_dim)."""
    pure_draft_prefix_len: int = 1
    """P: the first P slots keep the pure head's logits (dflash_config.pure_draft_prefix_len); SGLang 0.5.23 serves
    only 1."""
    lambda_base_start: float = 1.0
    """lambda at step 0 of L = (1 - lambda) L_final + lambda L_base, in [0, 1]; 0 turns the curriculum off (the final
    loss alone from the first step, no total step count needed). A training choice, not exported."""
    lambda_base_decay_ratio: float = 1.0
    """lambda falls linearly to 0 over this fraction of the run's total optimizer steps, in (0, 1] (SpecForge's
    default is 0.5; ModelOpt's and its Qwen3-8B recipe 1.0). Not exported."""
    candidate_pool_size: int = SGLANG_POOL
    """Drafting only: score the correction on each block's shared top-`candidate_pool_size` base candidates, as
    SGLang does by default (its --speculative-domino-candidate-pool-size); 0 scores the full vocabulary, as training
    does. Not exported: the serve command carries it."""

    def check(self, config: Any) -> None:
        """Raise ConfigError naming the field of a value that cannot work for the drafter `config`."""
        for name in ("gru_hidden_dim", "emb_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"domino.{name} must be an integer >= 1, got {value!r}")
        if self.pure_draft_prefix_len != 1:
            raise ConfigError(f"domino.pure_draft_prefix_len must be 1 (SGLang 0.5.23, the one engine that serves "
                              f"Domino, refuses other values), got {self.pure_draft_prefix_len!r}")
        block = getattr(config, "block_size", None)
        if block is not None and block < 2:
            raise ConfigError(f"domino: block_size must be >= 2 (slot 0 drafts with the pure head, the rest with the "
                              f"correction), got {block}")
        if not 0 <= self.lambda_base_start <= 1:
            raise ConfigError(f"domino.lambda_base_start must be in [0, 1] (0: no curriculum), got "
                              f"{self.lambda_base_start}")
        if not 0 < self.lambda_base_decay_ratio <= 1:
            raise ConfigError(f"domino.lambda_base_decay_ratio must be in (0, 1] (a fraction of the run's steps), got "
                              f"{self.lambda_base_decay_ratio}")
        if type(self.candidate_pool_size) is not int or self.candidate_pool_size < 0:
            raise ConfigError(f"domino.candidate_pool_size must be an integer >= 0 (0: the full vocabulary), got "
                              f"{self.candidate_pool_size!r}")

    @property
    def needs_total_steps(self) -> bool:
        """Whether lambda's schedule needs the run's total optimizer steps (a curriculum that starts above 0)."""
        return self.lambda_base_start > 0


def lambda_base(step: int, total_steps: int | None, start: float = 1.0, decay_ratio: float = 1.0) -> float:
    """The base loss's weight at optimizer step `step` (0 = the first) of a run of `total_steps`: `start`, falling
    linearly to 0 after `max(1, floor(decay_ratio * total_steps))` steps, then 0 (SpecForge's and ModelOpt's rule).

    A curriculum that starts above 0 needs a real total (`DominoSettings.needs_total_steps`); both trainers fall back
    to lambda = 0 without one, which silently trains without the curriculum, so here it is an error.
    """
    if start == 0:
        return 0.0
    if total_steps is None or total_steps < 1:
        raise ValueError(f"Domino's lambda schedule needs the run's total optimizer steps, got {total_steps!r}")
    decay_steps = max(1, int(total_steps * decay_ratio))
    return max(0.0, min(1.0, start * (1.0 - min(step / decay_steps, 1.0))))


# ---- the part's modules: the prefix GRU and the projector ------------------------------------------------------


def gru_step(weight_ih: Tensor, weight_hh: Tensor, gates_x: Tensor, state: Tensor) -> Tensor:
    """One step of PyTorch's GRU without biases (gate rows r, z, n), from the input's projection `gates_x =
    x @ weight_ih.T [N, 3G]` and the state `[N, G]`.  # [N, G]"""
    gates_h = F.linear(state, weight_hh)  # [N, 3G]
    xr, xz, xn = gates_x.chunk(3, -1)
    hr, hz, hn = gates_h.chunk(3, -1)
    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return n + z * (state - n)  # (1 - z) n + z s


def gru_states(weight_ih: Tensor, weight_hh: Tensor, inputs: Tensor, state: Tensor | None = None) -> Tensor:
    """The GRU's state after each input of sequences `inputs [N, T, H]`, from `state [N, G]` (None: zeros), by hand
    (a fixed T-step loop that torch.compile traces, where nn.GRU breaks the graph).  # [N, T, G]"""
    gates_x = F.linear(inputs, weight_ih)  # [N, T, 3G]: every step's input projection in one matmul
    if state is None:
        state = inputs.new_zeros(inputs.shape[0], weight_hh.shape[1])
    out = []
    for t in range(inputs.shape[1]):
        state = gru_step(weight_ih, weight_hh, gates_x[:, t], state)
        out.append(state)
    return torch.stack(out, 1)


class PrefixGRU(nn.Module):
    """PyTorch's one-layer GRU without biases, as parameters named as nn.GRU's (`weight_ih_l0 [3G, H]`,
    `weight_hh_l0 [3G, G]`, gate rows r, z, n) and run by `gru_states`: torch.compile refuses an nn.GRU module."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight_ih_l0 = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh_l0 = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.GRU's default: every weight uniform(-1/sqrt(G), 1/sqrt(G))."""
        bound = self.weight_hh_l0.shape[1] ** -0.5
        for w in (self.weight_ih_l0, self.weight_hh_l0):
            nn.init.uniform_(w, -bound, bound)

    def forward(self, inputs: Tensor, state: Tensor | None = None) -> Tensor:
        """States after each step of `inputs [N, T, H]`, from `state [N, G]` (None: zeros), in `inputs`' dtype.
        # [N, T, G]"""
        return gru_states(self.weight_ih_l0.to(inputs.dtype), self.weight_hh_l0.to(inputs.dtype), inputs, state)

    def step(self, inputs: Tensor, state: Tensor) -> Tensor:
        """The state after one more input `[N, H]`.  # [N, G]"""
        w_ih, w_hh = self.weight_ih_l0.to(inputs.dtype), self.weight_hh_l0.to(inputs.dtype)
        return gru_step(w_ih, w_hh, F.linear(inputs, w_ih), state.to(inputs.dtype))


class DominoHead(nn.Module):
    """`prefix_gru` (the GRU over the block's token embeddings, H -> G) and `embed_proj` (Linear(H + G -> E), SiLU,
    Linear(E -> V), no biases), named as the folder's weights are."""

    def __init__(self, hidden_size: int, vocab_size: int, gru_hidden_dim: int, emb_dim: int) -> None:
        super().__init__()
        self.prefix_gru = PrefixGRU(hidden_size, gru_hidden_dim)
        self.embed_proj = nn.Sequential(nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=False), nn.SiLU(),
                                        nn.Linear(emb_dim, vocab_size, bias=False))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """The trainers' init: the GRU PyTorch's default (uniform within 1/sqrt(G)), the projector normal(0, 0.02)."""
        self.prefix_gru.reset_parameters()
        for linear in (self.embed_proj[0], self.embed_proj[2]):
            nn.init.normal_(linear.weight, std=std)

    @property
    def proj_in(self) -> Tensor:
        """embed_proj.0.weight.  # [E, H + G]"""
        return self.embed_proj[0].weight

    @property
    def proj_out(self) -> Tensor:
        """embed_proj.2.weight.  # [V, E]"""
        return self.embed_proj[2].weight

    def states(self, embeddings: Tensor, state: Tensor | None = None) -> Tensor:
        """GRU states after each step of `embeddings [N, T, H]` (the target's input embeddings).  # [N, T, G]"""
        return self.prefix_gru(embeddings, state)

    def step(self, embedding: Tensor, state: Tensor) -> Tensor:
        """The state after one more token, of embedding `[N, H]`.  # [N, G]"""
        return self.prefix_gru.step(embedding, state)

    def correction(self, hidden: Tensor, state: Tensor) -> Tensor:
        """embed_proj([h; s]) of rows `hidden [..., H]`, `state [..., G]`, in `hidden`'s dtype.  # [..., V]"""
        x = torch.cat([hidden, state.to(hidden.dtype)], -1)
        return F.linear(F.silu(F.linear(x, self.proj_in.to(x.dtype))), self.proj_out.to(x.dtype))


def weight_shapes(settings: DominoSettings, hidden_size: int, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every weight of the part by its folder name (unprefixed, no biases) and shape."""
    g, e = settings.gru_hidden_dim, settings.emb_dim
    return {"prefix_gru.weight_ih_l0": (3 * g, hidden_size), "prefix_gru.weight_hh_l0": (3 * g, g),
            "embed_proj.0.weight": (e, hidden_size + g), "embed_proj.2.weight": (vocab_size, e)}


# ---- training: the prefix states (the loss is the head loop's, `DominoCorrection`) ------------------------------


def prefix_states(domino: DominoHead, embed_weight: Tensor, block_tokens: Tensor) -> Tensor:
    """s of every slot of every block: the GRU over the TARGET's frozen input embeddings (detached) of the block's
    true tokens `block_tokens [A, B]` (t_p..t_{p+B-1}); s_k has seen t_p..t_{p+k}.  # [A, B, G]

    Tokens past the document or the budget are whatever sits there: the GRU is causal, so they reach only slots that
    do not count."""
    return domino.states(embed_weight.detach()[block_tokens])


def corrected_slots(block_size: int, pure: int, device: torch.device | str | None = None) -> Tensor:
    """Which slots take the correction: k >= P.  # [B] bool"""
    return torch.arange(block_size, device=device) >= pure


# ---- decoding ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_draft(
    domino: DominoHead, hidden: Tensor, logits: Tensor, first: Tensor, embed_weight: Tensor, pure: int = 1,
    pool: int = 0,
) -> Tensor:
    """Greedy drafts of blocks as SGLang 0.5.23 drafts them (docs/method.md 13), from the drafting slots' backbone
    outputs `hidden [A, n, H]` (slots 0..n-1, slot k drafting position p + k + 1), their head logits `logits [A, n, V]`
    and the blocks' slot-0 tokens `first [A]` (x_p).  # [A, n]

    The first P drafts are argmax head(h_k); then s = GRU(E(x_p), E(d_1), .., E(d_P)), and each slot k >= P drafts
    d_{k+1} = argmax(head(h_k) + embed_proj([h_k; s])) and steps the GRU on E(d_{k+1}). `pool` > 0 (and < V) scores
    slots >= P on a block-shared candidate set, the top `pool` ids of their largest base logit over those slots
    (SGLang's --speculative-domino-candidate-pool-size, default 2048); 0 the full vocabulary, as training does.
    No engine samples Domino drafts: at any temperature q is a point mass on this chain (section 6b).
    """
    a, n, v = logits.shape
    drafts = [logits[:, k].argmax(-1) for k in range(min(pure, n))]
    if n <= pure:
        return torch.stack(drafts, 1)
    embed = embed_weight.to(hidden.dtype)
    prefix = torch.stack([first, *drafts], 1)  # [A, P + 1]
    state = domino.states(embed[prefix])[:, -1]  # [A, G]
    ids = None
    if 0 < pool < v:
        ids = logits[:, pure:].amax(1).topk(pool, -1).indices  # [A, pool], shared by the block's slots >= P
        rows = domino.proj_out[ids].to(hidden.dtype)  # [A, pool, E]
    for k in range(pure, n):
        x = torch.cat([hidden[:, k], state.to(hidden.dtype)], -1)
        bottleneck = F.silu(F.linear(x, domino.proj_in.to(x.dtype)))  # [A, E]
        if ids is None:
            score = logits[:, k] + F.linear(bottleneck, domino.proj_out.to(x.dtype))  # [A, V]
            pick = score.argmax(-1)
        else:
            score = logits[:, k].gather(1, ids) + (rows @ bottleneck[:, :, None])[..., 0]  # [A, pool]
            pick = ids.gather(1, score.argmax(-1, keepdim=True))[:, 0]
        drafts.append(pick)
        if k + 1 < n:
            state = domino.step(embed[pick], state)
    return torch.stack(drafts, 1)


# ---- the folder SGLang loads --------------------------------------------------------------------------------------


def folder_fields(settings: DominoSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """(dflash_config fields, top-level config.json fields) of a Domino folder; with section 7's DFlash fields and
    `architectures: ["DFlashDraftModel"]` (SGLang knows no other name for it) it is what SGLang 0.5.23 loads."""
    dflash = {"projector_type": PROJECTOR_TYPE, "shift_label": True,
              "pure_draft_prefix_len": settings.pure_draft_prefix_len, "gru_hidden_dim": settings.gru_hidden_dim,
              "emb_dim": settings.emb_dim}
    return dflash, {"emb_dim": settings.emb_dim}


def is_domino_folder(dflash: dict[str, Any]) -> bool:
    """Whether a DFlashDraftModel folder's dflash_config names Domino's projector."""
    return dflash.get("projector_type") == PROJECTOR_TYPE


def read_folder_fields(dflash: dict[str, Any], top: dict[str, Any], source: str) -> DominoSettings:
    """Domino's settings from a folder's dflash_config and top-level fields (training choices at their defaults),
    each refused by name where SGLang would refuse it or where this package does not train it."""
    if not is_domino_folder(dflash):
        raise ConfigError(f"{source}: dflash_config.projector_type must be 'domino', got "
                          f"{dflash.get('projector_type')!r}")
    shift = dflash.get("shift_label", top.get("shift_label"))
    if shift is not True:
        raise ConfigError(f"{source}: dflash_config.shift_label must be true (Domino's anchor-first block, slot k "
                          f"predicting p + k + 1; false is section 3's layout, not trained here), got {shift!r}")
    values = {}
    for key in ("pure_draft_prefix_len", "gru_hidden_dim"):
        value = dflash.get(key, top.get(key))
        if type(value) is not int:
            raise ConfigError(f"{source}: dflash_config.{key} must be an integer, got {value!r}")
        values[key] = value
    nested, top_level = dflash.get("emb_dim"), top.get("emb_dim")
    for where, value in (("dflash_config.emb_dim", nested), ("emb_dim", top_level)):
        if value is not None and type(value) is not int:
            raise ConfigError(f"{source}: {where} must be an integer, got {value!r}")
    if nested is not None and top_level is not None and nested != top_level:
        raise ConfigError(f"{source}: dflash_config.emb_dim ({nested}) and the top-level emb_dim ({top_level}) differ "
                          f"(SGLang refuses the folder)")
    if nested is None and top_level is None:
        raise ConfigError(f"{source}: a Domino folder needs dflash_config.emb_dim")
    settings = DominoSettings(emb_dim=nested if nested is not None else top_level, **values)
    try:
        settings.check(None)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return settings


def sglang_flags(settings: DominoSettings) -> list[str]:
    """What SGLang's launch command adds for a Domino folder beside `--speculative-algorithm DFLASH`: `--dtype
    bfloat16`, and the candidate pool drafting was evaluated with, when it is not SGLang's default.

    One `--dtype` serves target and drafter; its default `auto` takes the target config's dtype (float16 for a float32
    one), and SGLang's Domino runtime refuses to start unless the target's embedding and head are bf16 (docs/domino.md).
    """
    pool = settings.candidate_pool_size
    pool_flag = [] if pool == SGLANG_POOL else [f"--speculative-domino-candidate-pool-size {pool}"]
    return [f"--dtype {FOLDER_DTYPE}", *pool_flag]


VLLM_NOTE = ("vLLM has no Domino runtime: vLLM 0.34 builds a DFlashDraftModel folder as plain DFlash and refuses "
             "the projector's weights at load ('There is no module or parameter named prefix_gru'); serve it with "
             "SGLang")
"""What export says in place of a vLLM command (read from vLLM 0.34.0's qwen3_dflash.py and AutoWeightsLoader)."""


# ---- metrics ----------------------------------------------------------------------------------------------------


class DominoMetrics(Metric):
    """Teacher-forced accuracy per slot and accepted length of the corrected logits f and of the base logits head(h)
    over the drafting slots 0..B-2 (the served tau of a greedy block: teacher forcing feeds the GRU the true tokens,
    which along an accepted prefix are the drafted ones)."""

    full_state_update = False

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_size = block_size
        for name in ("slots", "final_right", "base_right"):
            self.add_state(name, torch.zeros(block_size), dist_reduce_fx="sum")  # [B]
        for name in ("final_accepted", "base_accepted", "blocks"):
            self.add_state(name, torch.zeros(()), dist_reduce_fx="sum")

    def update(self, rows: Tensor, labels: Tensor, supervised: Tensor) -> None:
        """`rows [A, B, 2]`: per slot whether f's and head(h)'s argmax is the label; `supervised [A, B]` (a prefix of
        each block, anchor-first)."""
        m = supervised.float()
        right = rows.float() * m[..., None]  # [A, B, 2]
        self.slots += m.sum(0)
        self.final_right += right[..., 0].sum(0)
        self.base_right += right[..., 1].sum(0)
        drafting = right[:, :-1]  # slot B-1 trains but does not draft
        block = m[:, 0]
        self.final_accepted += (drafting[..., 0].cumprod(-1).sum(-1) * block).sum()
        self.base_accepted += (drafting[..., 1].cumprod(-1).sum(-1) * block).sum()
        self.blocks += block.sum()

    def compute(self) -> dict[str, Tensor]:
        slots, blocks = self.slots.clamp_min(1), self.blocks.clamp_min(1)
        final, base = self.final_right / slots, self.base_right / slots  # [B]
        n = slots.sum()
        out = {"domino/acc": self.final_right.sum() / n, "domino/base_acc": self.base_right.sum() / n,
               "domino/tau": 1 + self.final_accepted / blocks, "domino/base_tau": 1 + self.base_accepted / blocks}
        for k in range(self.block_size):
            out[f"domino/acc/slot_{k:02d}"] = final[k]
            out[f"domino/base_acc/slot_{k:02d}"] = base[k]
        return out


class Curriculum(nn.Module):
    """lambda of the step, a 0-dim device tensor set in place (`DominoCorrection.set_step`): a compiled head loop
    reads each step's value without recompiling. A non-persistent buffer: it moves with the drafter, is never saved."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("lam", torch.zeros(()), persistent=False)


LAYOUT = BlockLayout(anchor_first=True, last_slot_drafts=False, gamma=7.0)
"""Section 13's block: section 12's anchor-first block (slot k predicts p + k + 1, all B slots trained) whose slots
0..B-2 draft (B - 1 drafts verified as a fill-in block's are); w_k = exp(-k / 7) unless gamma is set."""


class DominoCorrection(Part):
    """Domino's prefix GRU and projector, placed as the folder names them (`prefix_gru.*`, `embed_proj.*`), on the
    anchor-first block whose last slot is not drafted; its loss is the head loop's CE on f = head(h) + c, with the
    base logits' CE beside it (`logit_correction`), lambda fed each step (`set_step`)."""

    name = "domino"
    settings_type = DominoSettings
    config_fields: ClassVar[dict[str, str]] = {
        "pure_draft_prefix_len": "pure_draft_prefix_len", "gru_hidden_dim": "gru_hidden_dim", "emb_dim": "emb_dim"}
    """The shape fields; `projector_type` and `shift_label` (constants) join them in `export_fields`."""
    weight_prefix = None
    layout = LAYOUT
    # fp8_exempt stays false: the projector's weights are only ever read by hand (F.linear on `.weight`), never
    # through its modules' forward, so an FP8 training linear in their place computes nothing differently.
    own_loss = "Domino (model.drafter.domino) trains with section 13's loss"
    decodes = True
    opd_refusal = ("drafts from logits corrected by a GRU over the tokens drafted so far: the stage would have to "
                   "roll that chain out and train it on the draft's own tokens, which is not built")
    samples = False  # SGLang drafts greedily at every temperature
    head_rows = 1
    top_k = 1  # f's argmax, for the per-slot hits
    folder_dtype = FOLDER_DTYPE

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        s = self.settings
        self.block_size = config.block_size
        self.head = DominoHead(config.hidden_size, config.vocab_size, s.gru_hidden_dim, s.emb_dim)
        self.curriculum = Curriculum()
        self.prefix_states = prefix_states  # compiled in place by `compile_hooks`

    def attach(self, drafter: nn.Module) -> None:
        drafter.add_module("prefix_gru", self.head.prefix_gru)
        drafter.add_module("embed_proj", self.head.embed_proj)
        drafter.add_module("domino_curriculum", self.curriculum)  # no weights: only so that lambda moves with it

    @classmethod
    def owns(cls, key: str) -> bool:
        return key.startswith(("prefix_gru.", "embed_proj."))

    @classmethod
    def check_run(cls, settings: DominoSettings, run: RunSettings) -> None:
        """Section 13's loss is the CE of the data tokens over exp(-k / gamma) slot weights, and its curriculum falls
        over the run's real total of optimizer steps (refused where the run has none, never silently off)."""
        super().check_run(settings, run)  # `own_loss`
        total = run.total_steps
        if settings.needs_total_steps and total is not None and not 1 <= total < math.inf:
            raise ConfigError(f"model.drafter.domino.lambda_base_start={settings.lambda_base_start}: the base-to-final "
                              f"curriculum falls over the run's total optimizer steps, and this run has "
                              f"{'no end' if total == math.inf else f'{total:g}'}; set trainer.max_steps (or "
                              f"trainer.max_epochs), or model.drafter.domino.lambda_base_start=0 to train the "
                              f"final loss alone")

    def reset_parameters(self) -> None:
        self.head.reset_parameters()

    # --- training: the GRU states by autograd before the loop, the projector's gradients by hand inside it
    def set_step(self, step: int, total_steps: float | None) -> None:
        """lambda of this optimizer step; left as it is outside a fit with a known end (`check_run` refuses a fit
        without one)."""
        s = self.settings
        if total_steps is None or not math.isfinite(total_steps):
            return
        self.curriculum.lam.fill_(lambda_base(step, int(total_steps), s.lambda_base_start, s.lambda_base_decay_ratio))

    def compile_hooks(self, mode: str | None = None) -> None:
        self.prefix_states = torch.compile(prefix_states, mode=mode, dynamic=False)

    def head_params(self) -> tuple[Tensor, ...]:
        return self.head.proj_in, self.head.proj_out

    def head_inputs(self, batch: TrainInputs) -> tuple[Tensor, ...]:
        """Per row the GRU state s_k over the block's true tokens t_p..t_{p+k} (with its gradient to the GRU), and
        lambda (0-dim)."""
        tokens = batch.input_ids[batch.before]  # [A, B]: the token before each slot's label, t_{p+k}
        states = self.prefix_states(self.head, batch.embed_weight, tokens)  # [A, B, G]
        return states.flatten(0, 1), self.curriculum.lam

    def _rows(self, hidden: Tensor, states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x = [h; s], u = embed_proj.0(x) and where a row is corrected (slot >= P), in `hidden`'s dtype.
        # [R, H + G], [R, E], [R, 1]"""
        x = torch.cat([hidden, states.to(hidden.dtype)], -1)
        u = F.linear(x, self.head.proj_in.to(x.dtype))
        keep = corrected_slots(self.block_size, self.settings.pure_draft_prefix_len, x.device)
        return x, u, keep.repeat(x.shape[0] // self.block_size)[:, None].to(x.dtype)

    def logit_correction(self, rows: tuple[Tensor, ...], hidden: Tensor, like: Tensor) -> Correction:
        """c = embed_proj([h; s]) on slots >= P, 0 below; lambda the base logits' share."""
        states, lam = rows
        with torch.autocast(hidden.device.type, enabled=False):
            _, u, keep = self._rows(hidden, states)
            c = F.linear(F.silu(u) * keep, self.head.proj_out.to(u.dtype))  # [R, V]
        return Correction(c.to(like.dtype), lam)

    def head_chunk(self, chunk: HeadChunk) -> ChunkResult:
        """d/dc (the loop's, weighted here in place) to the projector's weights, the rows' hidden states and their
        GRU states. Logged: sum w CE(f), sum w CE(b); rows out: per row (f's argmax right, b's argmax right)."""
        states, _ = chunk.rows
        w = chunk.weights
        with torch.autocast(chunk.hidden.device.type, enabled=False):
            x, u, keep = self._rows(chunk.hidden, states)
            dt = x.dtype  # the compute dtype: the matmuls run in it, the weights' gradients add up in fp32
            sig = torch.sigmoid(u)
            a = u * sig * keep  # [R, E] silu(u) on corrected rows
            d_c = chunk.d_correction.mul_(w[:, None]).to(dt)  # [R, V] weighted d loss / dc
            grad_in, grad_out = chunk.grads
            grad_out.add_(d_c.T @ a)
            d_a = d_c @ self.head.proj_out.to(dt)  # [R, E]
            del d_c
            d_u = d_a * keep * sig * (1 + u * (1 - sig))  # silu'(u) = sigmoid(u) (1 + u (1 - sigmoid(u)))
            grad_in.add_(d_u.T @ x)
            d_x = d_u @ self.head.proj_in.to(dt)  # [R, H + G]
            h = chunk.hidden.shape[1]
            right = torch.stack([chunk.top_ids[:, 0] == chunk.labels, chunk.base_ids == chunk.labels], -1)
            logged = torch.stack([(w * chunk.ce).sum(), (w * chunk.base_ce).sum()])
            return ChunkResult(logged=logged, grad_hidden=d_x[:, :h], grad_inputs=(d_x[:, h:],), rows=(right,))

    def loss(self, batch: TrainInputs, head: HeadOutput | None, settings: Any) -> PartOutput:
        rows = head.rows[0].unflatten(0, batch.labels.shape)  # [A, B, 2]: every slot trains
        final, base = head.logged
        return PartOutput(logs={"domino/ce": final, "domino/base_ce": base, "domino/lambda": self.curriculum.lam},
                          rows=rows)

    @classmethod
    def metric(cls, block_size: int) -> Metric:
        return DominoMetrics(block_size)

    # --- decoding
    def draft(self, inputs: DraftInputs) -> Draft:
        """SGLang's greedy rollout over the drafting slots 0..B-2 (`greedy_draft`), with the candidate pool of
        `candidate_pool_size`. No engine samples Domino drafts: at every temperature q is a point mass on this chain
        (None), verified as section 6b says."""
        s = self.settings
        tokens = greedy_draft(self.head, inputs.hidden[None], inputs.logits[None], inputs.first_prev.reshape(1),
                              inputs.embed_weight, s.pure_draft_prefix_len, s.candidate_pool_size)
        return Draft(tokens[0])

    # --- export and import: the folder SGLang loads (section 13)
    @classmethod
    def export_fields(cls, settings: DominoSettings, config: Any = None) -> dict[str, Any]:
        return folder_fields(settings)[0]

    @classmethod
    def top_level_fields(cls, settings: DominoSettings, config: Any = None) -> dict[str, Any]:
        return folder_fields(settings)[1]

    @classmethod
    def sglang_args(cls, settings: DominoSettings) -> list[str]:
        return sglang_flags(settings)

    @classmethod
    def serve_notes(cls, settings: DominoSettings) -> list[str]:
        return [VLLM_NOTE]

    @classmethod
    def present_fields(cls, dflash: dict[str, Any]) -> list[str]:
        """A folder is Domino's where its projector_type says so (SGLang ignores other values)."""
        return ["projector_type"] if is_domino_folder(dflash) else []

    @classmethod
    def read_fields(cls, dflash: dict[str, Any], source: str) -> DominoSettings:
        return read_folder_fields(dflash, dflash, source)


__all__ = [
    "FOLDER_DTYPE", "LAYOUT", "PROJECTOR_TYPE", "SGLANG_POOL", "VLLM_NOTE", "Curriculum", "DominoCorrection",
    "DominoHead", "DominoMetrics", "DominoSettings", "PrefixGRU", "corrected_slots", "folder_fields", "greedy_draft",
    "gru_states", "gru_step", "is_domino_folder", "lambda_base", "prefix_states", "read_folder_fields",
    "sglang_flags", "weight_shapes",
]
