"""What a drafter part is, and how the drafter, the loss, the metrics, the decoder, evaluate, export and import call it.

A drafter is the DFlash backbone (docs/method.md sections 2-9) plus the parts its preset names
(`parts/presets.py`, the only place that names a variant). A part is one module that owns its settings and the run
settings it accepts, its block layout, its parameters and weight names, its training term, its metrics, its
drafting rule, its served report and its export fields; the backbone calls it through the hooks below and never
asks which part it is (docs/parts.md tabulates them).

How a new part plugs in:
1. `parts/<name>.py`: a settings dataclass (plain fields, a one-line docstring under each; shape fields and loss
   weights) with `check(config)`, and a `Part` subclass naming it in `settings_type`, its `name` (the
   `DrafterConfig` field holding the settings: `model.drafter.<name>.<field>` on the command line) and
   `config_fields` (the `dflash_config` keys it exports, mapped to settings fields); `layout` where it needs a
   block layout other than section 3's (`blocks.BlockLayout`: the preset derives its layout from its parts).
2. `config.py`: one field `<name>: <Settings> = field(default_factory=<Settings>)` on `DrafterConfig` (for
   `--help`; everything else that lists parts is derived from the presets).
3. `parts/presets.py`: the presets that include it (parts, `architectures` name, serve commands).
4. Override the hooks it needs; each has a do-nothing default. `check_run` refuses run settings it cannot train
   with, when the module is built and when fitting starts (`own_loss` declares the common case); what parts cannot
   do together in one preset (`term_conflicts`) is refused where the preset is made. Call order in one training step:
   `head_inputs` (before the chunked head loop) -> `logit_bias`, `logit_correction`, `head_chunk` (inside it, per
   chunk of whole blocks, with the `[rows, V]` logits that exist only there) -> `loss_denominator` and `loss` (after
   it, with what the chunks returned) ->
   the module logs `PartOutput.logs` every `metrics_every` steps and feeds `PartOutput.rows` to `metric()`.
   Decoding calls `draft` (the one part of a preset with `decodes = True`; else each slot's argmax), which returns
   a `Draft` (tokens, q, extras); `evaluate` calls every part's `served_report` with the served records and the
   `ServedSettings` (a cost model of a step, the calibration fitted for the temperature); `calibrate` calls
   `calibrate` with served records of prompts apart from the evaluation's, and export folds what it fitted into the
   weights (`fold_calibration`).
   Export writes `export_fields` and `top_level_fields`, import reads them with `read_fields`; warm start loads
   the weights the part `owns` only when the source has the part too.
5. `tests/test_contract.py`: its small settings in `TINY`; the contract test runs it and its presets through all of
   the above.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from dflash_lightning.blocks import FILL_IN, BlockLayout
from dflash_lightning.errors import ConfigError


@dataclass
class TrainInputs:
    """What a part's training hooks see of one packed batch (A anchors, B slots, T tokens)."""

    hidden: Tensor
    """The backbone's output after `norm`, every slot of every block.  # [A, B, H]"""
    context: Tensor
    """Context vectors c = hidden_norm(fc(features)) of every token of the batch.  # [T, H]"""
    input_ids: Tensor
    """Tokens of the packed batch.  # [T]"""
    position_ids: Tensor
    """Position of each token in its document (0 at a document's start).  # [T]"""
    doc_ids: Tensor
    """Document of each token (-1: padding).  # [T]"""
    anchors: Tensor
    """Position of each block's anchor (slot 0) in the batch.  # [A]"""
    anchor_valid: Tensor
    """Which anchors are real (the rest pad the fixed shape).  # [A]"""
    labels: Tensor
    """Target token of every slot.  # [A, B]"""
    supervised: Tensor
    """Slots that count (a valid anchor, a slot that predicts, anchor-first only a prefix, label in the loss mask
    and the anchor's document).  # [A, B]"""
    before: Tensor
    """Index in the batch of the token before each slot's label (`blocks.teacher_positions`; fill-in slot 1: the
    anchor), where the target's state that predicts the label sits: `final_hidden[before]` is the slot's teacher
    row.  # [A, B]"""
    final_hidden: Tensor | None
    """The target's final normed hidden states (None unless some part or the objective needs them).  # [T, H]"""
    embed_weight: Tensor
    """The target's input embedding, frozen.  # [V, H]"""
    head_weight: Tensor
    """The target's output head, frozen (full precision even when the loss's head runs in FP8).  # [V, H]"""
    layout: BlockLayout = FILL_IN
    """The block layout (`blocks.BlockLayout`): which position each slot predicts; the head loop's rows are slots
    `layout.first_slot..B-1` of every block."""

    @property
    def first_slot(self) -> int:
        """The first slot that predicts a token: 1, anchor-first 0 (`BlockLayout.first_slot`)."""
        return self.layout.first_slot


@dataclass
class HeadChunk:
    """One chunk of rows inside the chunked head loop (loss.py): rows are the trained slots (`first_slot..B-1`) of
    whole blocks."""

    start: int
    """First row of the chunk; rows `start:end` of every per-row tensor of the step."""
    end: int
    """One past the chunk's last row."""
    hidden: Tensor
    """The rows' hidden states, in the head's dtype.  # [R, H]"""
    logits: Tensor | None
    """The rows' logits, fp32 (fp64 in tests); only this chunk's exist at once. None where a part corrects the
    logits (`Part.logit_correction`): the loop has turned them into `d_correction` in place.  # [R, V]"""
    lse: Tensor
    """logsumexp of `logits` (with a correction: of the corrected logits f).  # [R, 1]"""
    labels: Tensor
    """Target token of each row.  # [R]"""
    weights: Tensor
    """Slot weight of each row this step (D-PACE: from this step's CE), in `logits`' dtype.  # [R]"""
    top_ids: Tensor
    """The unary top k ids of each row, best first, k >= the part's `top_k` (with a correction: of f, what is
    served).  # [R, k]"""
    d_logits: Tensor
    """d objective / d logits of the rows before the slot weights apply; a part adds its own term's gradient
    into it in place (the head's matmul then carries it to `hidden`). With a correction f = b + c: d / db, which
    holds d / dc too (b reaches the objective through f as well).  # [R, V]"""
    head: Tensor
    """The frozen head as the loop uses it (FP8 possibly): `F.linear(h, head)` are logits.  # [V, H]"""
    head_t: Tensor
    """Its transpose as the loop uses it: `F.linear(d_logits, head_t)` maps `[R, V]` back to `[R, H]`.  # [H, V]"""
    rows: tuple[Tensor, ...]
    """The part's own inputs (`head_inputs`) for the chunk: per-row ones sliced to its rows, per-block ones to its
    blocks, 0-dim ones whole."""
    grads: list[Tensor]
    """fp32 accumulators of the gradients of the part's `head_params`, to add into."""
    ce: Tensor | None = None
    """CE of each row's logits against its label (with a correction: of f), no gradient.  # [R]"""
    d_correction: Tensor | None = None
    """With the part's correction c (`logit_correction`): d objective / dc of the rows, before the slot weights
    apply, (1 - lambda) (softmax f - onehot) times `objective_weight`; None otherwise.  # [R, V]"""
    base_ce: Tensor | None = None
    """With a correction: the CE of the base logits b against the label, no gradient.  # [R]"""
    base_ids: Tensor | None = None
    """With a correction: the argmax of the base logits b.  # [R]"""


@dataclass
class Correction:
    """A part's correction of a chunk's logits (`Part.logit_correction`): the loop serves f = b + c and trains
    `objective_weight` * ((1 - base_weight) objective(f) + base_weight objective(b)), b the base logits."""

    logits: Tensor
    """c, in the dtype of the logits it corrects (rows whose correction is 0 hold zeros); the loop may reuse its
    buffer.  # [R, V]"""
    base_weight: Tensor | float = 0.0
    """lambda, the share of the base logits' objective; a 0-dim tensor where it changes during the run (a compiled
    loop then takes each step's value without recompiling)."""


@dataclass
class ChunkResult:
    """What a part's `head_chunk` returns; every field optional."""

    loss: Tensor | None = None
    """Its weighted term over the rows, sum(w * term) times its loss weight: joins the objective's sum (divided by the
    step's denominator, `Part.loss_denominator`)."""
    logged: Tensor | None = None
    """A 0-dim sum over the rows to report, or a few such sums stacked `[n]` (divided by the step's denominator like
    the loss): `HeadOutput.logged`."""
    grad_hidden: Tensor | None = None
    """d loss / d hidden of the rows from paths that skip the head's matmul (weighted).  # [R, H]"""
    grad_inputs: tuple[Tensor | None, ...] = ()
    """d loss / d each of the chunk's `rows` (weighted; the part's `head_inputs` in order, shorter or None where
    there is none), for its inputs that require a gradient: the loop hands them to autograd.  # as `rows`"""
    rows: tuple[Tensor, ...] = ()
    """Per-row results the part reads later (`HeadOutput.rows`), `head_rows` of them: concatenated over chunks, no
    gradient.  # [R, ...] each"""


@dataclass
class HeadOutput:
    """What the head loop hands back to a part's `loss`: its chunk results joined over the step."""

    logged: Tensor | None
    """The sum of `ChunkResult.logged` over chunks, divided by the step's denominator (the rank-mean weight sum, or
    a part's `loss_denominator`)."""
    rows: tuple[Tensor, ...]
    """`ChunkResult.rows` of every row, in order.  # [A * (B - first_slot), ...] each"""


@dataclass
class PartOutput:
    """A part's results of one training forward."""

    loss: Tensor | None = None
    """A term added to the (normalised) loss after the head loop; None: none (or it joined in `head_chunk`)."""
    logs: dict[str, Tensor] = field(default_factory=dict)
    """0-dim values logged as `train/<name>` every `metrics_every` steps (names carry the part's `prefix()`)."""
    rows: Any = None
    """What `metric().update` takes besides the slots' labels and supervision, e.g. per-slot hits `[A, B, ...]`."""


@dataclass
class DraftInputs:
    """What a part's drafting rule sees of one block being drafted (serving, evaluate, spec_eval)."""

    hidden: Tensor
    """The backbone's output after `norm` for the drafting slots (`BlockLayout.draft_slots`: 1..B-1, DSpark's
    0..B-1, Domino's 0..B-2).  # [n, H]"""
    logits: Tensor
    """Their unary logits through the target's head.  # [n, V]"""
    first_prev: Tensor
    """The block's slot-0 token (the last committed token x).  # 0-dim"""
    context_last: Tensor | None
    """c_{p-1}: the context vector of the last committed position with target features (None at p = 0).  # [H]"""
    embed_weight: Tensor
    """The target's input embedding.  # [V, H]"""
    temperature: float
    """0: greedy; above: sample from the part's q."""
    generator: torch.Generator | None
    """The random stream of sampling."""
    block_hidden: Tensor | None = None
    """The backbone's output after `norm` of every slot of the block, drafting or not (a refiner that reads the
    whole block, as XPress's mean over slots 0..B-1).  # [B, H]"""


@dataclass
class Draft:
    """What drafting one block returns (`Part.draft`, `SpeculativeDecoder.draft`): what was drafted, never state a
    caller reads off the drafter afterwards."""

    tokens: Tensor
    """The drafts, in slot order.  # [n]"""
    q: Tensor | None = None
    """The draft distribution each draft was sampled from, which verification uses (docs/method.md 6b, 10); None:
    point masses (greedy, or a rule that samples none).  # [n, V]"""
    extras: dict[str, Tensor] = field(default_factory=dict)
    """A part's own values of each draft (DSpark: `{"confidence": c_k}`): `Generation.extras` records them per
    step, and the part's `served_report` reads them.  # [n] each"""


@dataclass(frozen=True)
class VerifyCost:
    """The cost of one decode step that an engine's adaptive verification weighs (docs/dspark.md): drafting a block,
    then one target forward over the last token and the n drafts admitted, `draft + 1 + per_token * n`, in target
    forwards of one token. vLLM profiles these costs when it starts, SGLang reads them from its
    `--speculative-dspark-sps-table-path`; `evaluate` simulates their rule under this model."""

    draft: float = 0.1
    """The drafter's forward for one block, in target forwards of one token."""
    per_token: float = 0.05
    """What each draft verified adds to the target's forward, in target forwards of one token (about 0 for one
    request on a GPU, larger as the batch fills it)."""

    def __post_init__(self) -> None:
        for name in ("draft", "per_token"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value < float("inf")):
                raise ConfigError(f"verify_cost.{name} must be a finite number >= 0, got {value!r}")

    def step(self, drafts: int) -> float:
        """The cost of a step that verifies `drafts` drafts."""
        return self.draft + 1.0 + self.per_token * drafts


@dataclass(frozen=True)
class ServedSettings:
    """What `evaluate` hands a part's `served_report` besides the served records."""

    cost: VerifyCost = field(default_factory=VerifyCost)
    """The step's cost model of adaptive verification."""
    calibration: dict[str, Any] | None = None
    """What `calibrate` fitted for this serving temperature, by part name (`Calibration.fit`); None: none given."""


@dataclass
class Calibration:
    """What a part's `calibrate` fitted on the served blocks of one serving temperature."""

    fit: dict[str, Any]
    """JSON values that `fold_calibration` folds into the weights (export) and `served_report` applies (evaluate)."""
    report: dict[str, Any]
    """Measures on the calibration blocks before and after, for calibration.json."""
    files: dict[str, str] = field(default_factory=dict)
    """Files to write beside calibration.json, name -> text (DSpark: SGLang's per-slot temperatures, sts.json); the
    command puts the temperature in each name (sts-T1.json)."""
    lines: list[str] = field(default_factory=list)
    """What the command prints of it, one line each."""


@dataclass(frozen=True)
class RunSettings:
    """What a part's `check_run` sees of the run that trains it."""

    objective: str
    """`model.objective`: ce, kl or ce+kl (docs/method.md 4c)."""
    loss_weights: str
    """`model.loss_weights`: decay or dpace (section 4b)."""
    gamma: float
    """The slot weights' decay gamma as the run uses it (`model.drafter.gamma`, else the block layout's default)."""
    gamma_set: bool
    """Whether `model.drafter.gamma` was set (false: the layout's default)."""
    final_hidden: bool
    """Whether every batch carries the target's final hidden states (the objective distills, or a part
    `needs_final_hidden`): what the target must provide beside the context features."""
    total_steps: float | None = None
    """The run's optimizer steps: None while the module is built (no Trainer yet); when fitting starts, the
    Trainer's total (`math.inf` where the run has no end)."""

    def require_own_loss(self, part: str) -> None:
        """Refuse, for a part whose loss is its own (`part`: 'XPress (model.drafter.xpress) trains with section 14's
        loss'), a distillation objective or D-PACE weights, naming only the settings that are not ce and decay."""
        wrong = [(name, value, want) for name, value, want in (("objective", self.objective, "ce"),
                                                                ("loss_weights", self.loss_weights, "decay"))
                 if value != want]
        if wrong:
            raise ConfigError(f"{', '.join(f'model.{n}={v}' for n, v, _ in wrong)}: {part}: set "
                              f"{' and '.join(f'model.{n}={w}' for n, _, w in wrong)}")


class Part(nn.Module):
    """A part of a drafter (see the module docstring): its settings, parameters and weight names, then its four
    facets, one section each (training term, drafting rule, folder fields, serving: docs/parts.md says why they are
    sections of one class). Subclasses set the class variables and override the hooks they need."""

    # --- what it is: its settings, its parameters and their weight names
    name: ClassVar[str]
    """The `DrafterConfig` field holding this part's settings (`model.drafter.<name>.*`)."""
    settings_type: ClassVar[type]
    """The part's settings dataclass."""
    legacy_fields: ClassVar[dict[str, str]] = {}
    """Flat DrafterConfig fields of checkpoints written before parts had their own settings -> the settings field
    now (`config.upgrade_fields`)."""
    legacy_record: ClassVar[dict[str, str]] = {}
    """Other run-record keys of older checkpoints -> the settings field now (`config.upgrade_record`)."""
    weight_prefix: ClassVar[str | None] = None
    """Where the part sits in the drafter (`drafter.<weight_prefix>`, its weights `<weight_prefix>.*`); None: the
    part places its modules itself (`attach`) and names them in `owns`."""
    changes_backbone: ClassVar[bool] = False
    """Whether the part changes the backbone's hidden states (block convolutions): a drafter trained with it is
    never warm-started without it."""
    layout: ClassVar[BlockLayout | None] = None
    """The block layout the part needs (DSpark: anchor-first); None: any, the preset's is section 3's unless
    another of its parts names one (`Preset.layout`; two parts naming different layouts cannot share a preset)."""

    def __init__(self, config: Any) -> None:
        """`config` is the resolved DrafterConfig; the part's settings are `getattr(config, self.name)`."""
        super().__init__()
        self.settings = getattr(config, self.name)

    @classmethod
    def layer_modules(cls, config: Any) -> dict[str, tuple[str, nn.Module]]:
        """Modules the part adds to every decoder layer, built while the layer is (so the random stream is drawn in
        module order): sublayer (`attention` or `mlp`) -> (attribute name, module); the layer calls
        `module(x, sublayer)` in place of `sublayer(x)` on its normed block tokens. None by default."""
        return {}

    def attach(self, drafter: nn.Module) -> None:
        """Place the part in the drafter once the backbone is built (after `norm`), where its weight names say
        (default: `drafter.<weight_prefix>`); a part with `layer_modules` finds them in `drafter.layers`."""
        if self.weight_prefix is None:
            raise NotImplementedError(f"{type(self).__name__}: set weight_prefix or override attach")
        drafter.add_module(self.weight_prefix, self)

    def reset_parameters(self) -> None:
        """The part's initialisation (called after the backbone's, so a part's own init wins)."""

    @classmethod
    def owns(cls, key: str) -> bool:
        """Whether a weight name of a drafter's state dict is this part's."""
        return cls.weight_prefix is not None and key.startswith(cls.weight_prefix + ".")

    # --- the training term: the run settings it accepts, its work inside the chunked head loop and after it, its
    # metrics (the module, the drafter's forward, loss.py; `Preset` refuses terms that cannot share a preset)
    needs_final_hidden: ClassVar[bool] = False
    """Whether training reads the target's final hidden states (`TrainInputs.final_hidden`)."""
    own_loss: ClassVar[str | None] = None
    """Where the part's training term is the whole loss (its section's: the CE objective over decay weights, no
    distillation beside it, no D-PACE), what a refusal says of it ("XPress (model.drafter.xpress) trains with
    section 14's loss"); `check_run` then refuses other run settings. None: any objective and weights."""
    alone_in_loop: ClassVar[str | None] = None
    """Why no other part may work in the head loop beside this one (DSpark: its `head_chunk` takes the loop's
    finished gradient to its weights); a part that corrects the logits is alone without saying so. Refused where
    the preset is made (`Preset`). None: it shares the loop."""
    fp8_exempt: ClassVar[bool] = False
    """Whether the part's linears stay out of FP8 training (`model.fp8=all`): those whose weights the loss reads by
    hand (`head_params`)."""
    opd_refusal: ClassVar[str | None] = None
    """Why the Draft-OPD stage (`model.stage=opd`, opd.py) cannot train a drafter with this part, completing "its
    <name> part ..."; None: it can (the stage drafts each slot's argmax and trains each slot's unary distribution)."""
    head_rows: ClassVar[int] = 0
    """How many per-row tensors `head_chunk` returns in `ChunkResult.rows`."""
    metric_prefix: ClassVar[str | None] = None
    """The prefix of every name the part logs (`<prefix>/...`: its `PartOutput.logs` and its metric's); None: its
    `name`."""
    top_k: int = 0
    """Unary candidates per row the part reads from the head loop (`HeadChunk.top_ids`); 0: none."""

    @classmethod
    def check_run(cls, settings: Any, run: RunSettings) -> None:
        """Refuse, in one ConfigError line naming the field, run settings the part cannot train with (its own are
        checked by `settings.check`). Called when the module is built (`run.total_steps` None) and again when
        fitting starts, with the Trainer's total. By default: the `own_loss` rule."""
        if cls.own_loss is not None:
            run.require_own_loss(cls.own_loss)

    def set_step(self, step: int, total_steps: float | None) -> None:
        """Before each training step's forward: the optimizer steps done (0 at the first) and the run's total
        (`RunSettings.total_steps`; None outside a fit). A part whose training changes over the run (Domino's lambda)
        updates its own 0-dim device tensors here in place, never Python values a compiled graph would bake in.
        Nothing by default."""

    def compile_hooks(self, mode: str | None = None) -> None:
        """Compile the part's own training work in place at fixed shapes (`model.compile`; the head loop, and the
        modules it adds to the layers, are compiled with the backbone's); nothing by default."""

    def head_params(self) -> tuple[Tensor, ...]:
        """Parameters whose gradients `head_chunk` accumulates by hand (in `HeadChunk.grads`)."""
        return ()

    def head_inputs(self, batch: TrainInputs) -> tuple[Tensor, ...] | None:
        """Inputs of `head_chunk`, or None: the part has no `head_chunk`. Each is per row (first dim N: slots
        first_slot..B-1 of each block, flattened), per block (first dim A) or 0-dim; the loop hands each chunk its
        rows, its blocks, and the 0-dim ones whole (`HeadChunk.rows`). One that requires a gradient (made by
        autograd before the loop: Domino's GRU states) gets the gradients `head_chunk` returns in
        `ChunkResult.grad_inputs`."""
        return None

    def logit_bias(self, rows: tuple[Tensor, ...], like: Tensor) -> Tensor | None:
        """A term added to the rows' head logits `like [R, V]` before the loop's objective, top-k and `head_chunk`
        (DSpark's Markov head: the slot's logits are head(h) + its term), from the part's `rows` (its head inputs
        sliced to the chunk), in `like`'s dtype; None: none.  # [R, V]"""
        return None

    def logit_correction(self, rows: tuple[Tensor, ...], hidden: Tensor, like: Tensor) -> Correction | None:
        """A correction c of the rows' logits `like [R, V]` (the base logits b, `logit_bias` included) from the part's
        `rows` and the rows' `hidden [R, H]`: the loop serves f = b + c (its top-k and CE are f's) and trains
        (1 - lambda) objective(f) + lambda objective(b) (Domino, docs/method.md 13); `head_chunk` then gets
        `HeadChunk.d_correction` and takes it to the part's weights and inputs. A part that corrects the logits works
        alone in the loop. None: no correction."""
        return None

    def objective_weight(self) -> float:
        """The scale of the head loop's own objective (section 4's CE or 4c's KL) beside the part's terms (DSpark:
        0.1 on the CE); 1 by default. 0: the loop computes neither that objective nor its gradient (`d_logits` starts
        at zero for the part's terms)."""
        return 1.0

    def head_chunk(self, chunk: HeadChunk) -> ChunkResult:
        """The part's work on one chunk of rows while their full logits exist (see `HeadChunk`)."""
        return ChunkResult()

    def loss_denominator(self, batch: TrainInputs) -> Tensor | None:
        """What the step's summed loss (the head loop's objective and every part's `head_chunk` terms, and their
        `logged` sums) is divided by, before its mean over data-parallel ranks; None: the slot weights' sum
        (section 4). At most one part of a preset sets it."""
        return None

    def loss(self, batch: TrainInputs, head: HeadOutput | None, settings: Any) -> PartOutput:
        """The part's term and logs after the head loop; `settings` are the run's LossSettings."""
        return PartOutput()

    @classmethod
    def metric(cls, block_size: int) -> Any:
        """A torchmetrics Metric whose `update(rows, labels, supervised)` takes `PartOutput.rows`, and whose
        `compute()` returns `{name: 0-dim tensor}` (names carry the part's `prefix()`); None: no metrics."""
        return None

    @classmethod
    def prefix(cls) -> str:
        """The prefix of the names the part logs: `metric_prefix`, else its `name`."""
        return cls.metric_prefix or cls.name

    # --- the drafting rule, in place of each slot's argmax (the decoders, `evaluate`, the OPD stage)
    decodes: ClassVar[bool] = False
    """Whether the part replaces each slot's argmax by its own drafting rule (`draft`); one such part a preset."""
    samples: ClassVar[bool] = True
    """Whether its drafting rule samples above temperature 0 (a `Draft.q`); False: point masses at every temperature
    (Domino: no engine samples its drafts), verified as docs/method.md 6b says."""

    def draft(self, inputs: DraftInputs) -> Draft:
        """The drafts of the drafting slots, their draft distributions q when sampled (verified with q,
        docs/method.md 6b and 10) and the part's extras. Only for parts with `decodes = True`."""
        raise NotImplementedError

    # --- the folder's fields: what export writes and import reads, and other trainers' folders it converts
    config_fields: ClassVar[dict[str, str]] = {}
    """dflash_config key -> settings field, in the order export writes them; the other settings fields are
    training choices (loss weights) a folder does not carry."""
    folder_defaults: ClassVar[dict[str, Any]] = {}
    """`config_fields` keys the engines read at a default where a folder lacks them (XPress's: vLLM's), so import
    reads them so too (`read_fields`) instead of refusing the folder."""
    folder_dtype: ClassVar[str | None] = None
    """The weights' dtype every engine that serves the part requires (Domino: bfloat16, SGLang's): `export` writes it
    when no dtype is given and refuses another in one line; None: any."""

    @classmethod
    def export_fields(cls, settings: Any, config: Any = None) -> dict[str, Any]:
        """The `dflash_config` fields of a folder with this part (`config`: the drafter's resolved DrafterConfig,
        for fields such as the block size that are not the part's settings)."""
        return {key: getattr(settings, name) for key, name in cls.config_fields.items()}

    @classmethod
    def top_level_fields(cls, settings: Any, config: Any = None) -> dict[str, Any]:
        """config.json fields outside `dflash_config` (DSpark's engines read theirs there, its block layout's
        `sample_from_anchor` too), from the part's settings and the drafter's `config`; none by default."""
        return {}

    @classmethod
    def present_fields(cls, dflash: dict[str, Any]) -> list[str]:
        """The part's `dflash_config` keys a folder's config holds."""
        return [key for key in cls.config_fields if dflash.get(key) is not None]

    @classmethod
    def read_fields(cls, dflash: dict[str, Any], source: str) -> Any:
        """The part's settings from a folder's `dflash_config` (training-only fields at their defaults)."""
        values = {}
        kinds = {f.name: f.type for f in fields(cls.settings_type)}
        for key, name in cls.config_fields.items():
            value = dflash[key]
            want = {"int": int, "float": float, "bool": bool}.get(str(kinds[name]), None)
            if want is int and type(value) is not int:
                raise ConfigError(f"{source}: dflash_config.{key} must be an integer, got {value!r}")
            if want is float and (type(value) not in (int, float)):
                raise ConfigError(f"{source}: dflash_config.{key} must be a number, got {value!r}")
            if want is bool and type(value) is not bool:
                raise ConfigError(f"{source}: dflash_config.{key} must be true or false, got {value!r}")
            values[name] = float(value) if want is float else value
        return cls.settings_type(**values)

    @classmethod
    def convert_folder(cls, raw: dict[str, Any], state: dict[str, Tensor], source: str,
                       num_target_layers: int | None) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
        """Another trainer's own folder of the part's variant (its config.json `raw` and weights `state`) as the folder
        export writes and the engines serve, (config.json, weights); None (the default): not such a folder.
        `num_target_layers` is the target's layer count where the caller knows it (such a folder may not say it)."""
        return None

    # --- serving: what the engines are told beyond the folder, and what `evaluate` and `calibrate` make of the
    # served records

    @classmethod
    def speculative_config(cls, settings: Any) -> dict[str, Any]:
        """Keys the part adds to vLLM's `--speculative-config` in the serve command `export` prints; none by
        default."""
        return {}

    @classmethod
    def sglang_args(cls, settings: Any) -> list[str]:
        """Flags the part adds to SGLang's launch command in the serve command `export` prints; none by default."""
        return []

    @classmethod
    def serve_notes(cls, settings: Any) -> list[str]:
        """Lines `export` prints after the serve commands: what an engine does with the part's folder that a user
        must know (Domino: that vLLM has no runtime for it); none by default."""
        return []

    @classmethod
    def served_report(cls, records: list[dict[str, Any]], settings: ServedSettings | None = None) -> dict[str, Any]:
        """Keys the part adds to `evaluate`'s report of one temperature, from its served records (per prompt:
        `accepted_lengths`, the accepted drafts of each step; `verified_lengths`, the drafts each step verified;
        `extras`, `{name: one list per step}` of the part's `Draft.extras`; `step_tokens`, ...) and the
        `settings` (None: the defaults); nothing by default."""
        return {}

    @classmethod
    def calibrate(cls, records: list[dict[str, Any]], state: dict[str, Tensor]) -> Calibration | None:
        """What the part fits on served records of one temperature (prompts apart from the evaluation's) for the
        drafter's weights `state`; None: the part has nothing to calibrate (the default)."""
        return None

    @classmethod
    def fold_calibration(cls, state: dict[str, Tensor], fit: dict[str, Any], source: str) -> dict[str, Tensor]:
        """The weights with the part's `Calibration.fit` folded in (export), refusing in one ConfigError line naming
        `source` a fit made for other weights; only for parts whose `calibrate` fits something."""
        raise ConfigError(f"{source}: {cls.__name__} has no calibration to fold")


def overrides(part: type[Part], hook: str) -> bool:
    """Whether a part overrides one of `Part`'s hooks (`hook` its name): what the presets and the stages read of
    a part's training term and serving without building it."""
    return next(cls for cls in part.__mro__ if hook in vars(cls)) is not Part


def calibrates(part: type[Part]) -> bool:
    """Whether a part fits a calibration (overrides `Part.calibrate`)."""
    return overrides(part, "calibrate")


def term_conflicts(parts: tuple[type[Part], ...]) -> list[str]:
    """Why these parts' training terms and drafting rules cannot make one preset (none: they can): two drafting
    rules, two denominators of the step's loss, or a part that works alone in the head loop beside another."""
    named = ", ".join
    why = []
    if len(rules := [p.__name__ for p in parts if p.decodes]) > 1:
        why.append(f"two parts draft (Part.decodes): {named(rules)}")
    if len(own := [p.__name__ for p in parts if overrides(p, "loss_denominator")]) > 1:
        why.append(f"two parts set the loss's denominator (Part.loss_denominator): {named(own)}")
    in_loop = [p for p in parts if overrides(p, "head_inputs")]
    corrects = "corrects the logits, which the loop turns into their gradients in place: no other part may read them"
    for part in in_loop:
        alone = part.alone_in_loop or (corrects if overrides(part, "logit_correction") else None)
        if alone and len(in_loop) > 1:
            others = named(p.__name__ for p in in_loop if p is not part)
            why.append(f"{part.__name__} cannot share the head loop with {others}: it {alone}")
            break
    return why


__all__ = ["Calibration", "ChunkResult", "Correction", "Draft", "DraftInputs", "HeadChunk", "HeadOutput", "Part",
           "PartOutput", "RunSettings", "ServedSettings", "TrainInputs", "VerifyCost", "calibrates", "overrides",
           "term_conflicts"]
