"""`DFlashModule`'s settings in groups that check themselves; an error names the setting's full path (`model.lr`).

The CLI's names stay flat (`--model.lr`, as the module's signature and every YAML config give them): a group's fields
are those names, so checkpoints record and resume the same keys.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch

from dflash_lightning.config import ConfigError, DrafterConfig, check_unused_parts
from dflash_lightning.fp8 import Recipe, require_fp8
from dflash_lightning.long_runs import lightning_compat as compat
from dflash_lightning.long_runs.nonfinite import NonFiniteSettings
from dflash_lightning.loss import LossSettings
from dflash_lightning.opd import OPDSettings
from dflash_lightning.parts.base import RunSettings

STAGES = ("sft", "opd")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


def _check(*rules: tuple[bool, str]) -> None:
    """Raise the message of the first rule that does not hold."""
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


@dataclass(frozen=True)
class StepSettings:
    """The shape of one training step: T tokens of B-token blocks, A anchors, the head's rows at once.

    Args:
        token_budget: Tokens per packed batch T (linked from `data.token_budget` in the CLI).
        num_anchors: Anchors (blocks) drafted per batch A; unused slots are masked out.
        head_chunk_size: Rows of the frozen head's logits made at once in the loss (rounded down to whole
            blocks, at least one).
    """

    block_size: int  # the drafter's
    token_budget: int
    num_anchors: int
    head_chunk_size: int

    def __post_init__(self) -> None:
        t, block_size = self.token_budget, self.block_size
        _check((t >= block_size, f"model.token_budget ({t}) must be >= block_size ({block_size})"),
               (1 <= self.num_anchors <= t, f"model.num_anchors must be in 1..token_budget ({t}), got "
                                            f"{self.num_anchors}"),
               (self.head_chunk_size >= 1, f"model.head_chunk_size must be >= 1, got {self.head_chunk_size}"))


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and its learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr`.

    Args:
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_ratio: Fraction of the steps spent in linear warmup before cosine decay.
        min_lr_ratio: Final learning rate as a fraction of `lr`.
    """

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_ratio: float
    min_lr_ratio: float

    def __post_init__(self) -> None:
        lr, decay, betas, warmup, low = self.lr, self.weight_decay, self.betas, self.warmup_ratio, self.min_lr_ratio
        _check((0 < lr < math.inf, f"model.lr must be a finite number > 0, got {lr}"),
               (0 <= decay < math.inf, f"model.weight_decay must be a finite number >= 0, got {decay}"),
               (len(betas) == 2 and all(0 <= b < 1 for b in betas),
                f"model.betas must be two numbers in [0, 1), got {list(betas)}"),
               (0 <= warmup < 1, f"model.warmup_ratio must be in [0, 1) (a fraction of the steps), got {warmup}"),
               (0 <= low <= 1, f"model.min_lr_ratio must be in [0, 1] (a fraction of lr), got {low}"))

    def schedule(self, total: int) -> Callable[[int], float]:
        """The learning rate's factor at each of `total` steps (LambdaLR's)."""
        warmup = int(self.warmup_ratio * total)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return factor

    def restore(self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        """Set lr, betas and weight decay to these values in a resumed optimizer; the schedule's position stays the
        checkpoint's."""
        for group, decay in zip(optimizer.param_groups, (self.weight_decay, 0.0), strict=True):
            group.update(betas=tuple(self.betas), weight_decay=decay, initial_lr=self.lr)
        scheduler.base_lrs = [self.lr] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = self.lr * factor(scheduler.last_epoch)  # what LambdaLR computes, with this run's lr
        compat.set_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])


@dataclass(frozen=True)
class CompileSettings:
    """torch.compile of the drafter's layers and head loss.

    Args:
        compile: Compile the drafter's layers and head loss in place after its buffers exist.
        compile_mode: torch.compile mode (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs").
        compile_cache_dir: Persistent compiler cache (sets TORCHINDUCTOR_CACHE_DIR); runs that share it skip
            the cold compile (33 s for the Qwen3-8B recipe on an H200, 5 s warm).
    """

    compile: bool
    compile_mode: str | None
    compile_cache_dir: str | None

    def __post_init__(self) -> None:
        _check((self.compile_mode in COMPILE_MODES,
                f"model.compile_mode must be null or one of {COMPILE_MODES[1:]}, got {self.compile_mode!r}"))


@dataclass(frozen=True)
class MetricSettings:
    """What a measured step reports, and how often.

    Args:
        metrics_every: Compute and log accuracy and acceptance metrics every N training batches.
        topk: Top-k accuracies to report; must include 1.
    """

    metrics_every: int
    topk: tuple[int, ...]

    def __post_init__(self) -> None:
        topk = list(self.topk)
        _check((self.metrics_every >= 1, f"model.metrics_every must be >= 1, got {self.metrics_every}"),
               (1 in topk and min(topk) >= 1,
                f"model.topk must include 1 (plain accuracy) and hold k >= 1 only, got {topk}"))

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a k above the target's vocabulary (known once its config is read)."""
        _check((max(self.topk) <= vocab_size,
                f"model.topk: each k must be in 1..vocab_size ({vocab_size}), got {list(self.topk)}"))


@dataclass(frozen=True)
class FP8Settings:
    """FP8 matmuls on Hopper GPUs (torchao).

    Args:
        fp8: FP8 matmuls on Hopper GPUs (torchao): `head` runs the frozen head's logits and hidden-state
            gradient in FP8, `all` also trains the drafter's linear layers in FP8 (over the same master weights).
        fp8_recipe: FP8 scaling of the drafter's linears (torchao's recipe names): `tensorwise`, `rowwise`,
            `rowwise_with_gw_hp` (the weight-gradient GEMM in bf16), or `rowwise_forward_only` (both backward
            GEMMs in bf16); the frozen head scales per tensor for `tensorwise`, else per row.
    """

    fp8: Literal["none", "head", "all"]
    fp8_recipe: Recipe

    def check_device(self, device: torch.device, precision: str | None, off: str | None = None) -> None:
        """Refuse FP8 off Hopper-class GPUs or outside bf16 (`precision`: the Trainer's; `off`: the flags a refusal
        names)."""
        if self.fp8 == "none":
            return
        if precision not in (None, "bf16-mixed", "bf16-true"):  # FP8 matmuls return bf16
            raise ConfigError(f"model.fp8={self.fp8} needs trainer.precision bf16-mixed, not {precision}")
        require_fp8(device, f"model.fp8={self.fp8}", off)


@dataclass(frozen=True)
class StageSettings:
    """The training stage (`sft` or Draft-OPD's `opd`), its settings, and the drafter a run starts from.

    Args:
        stage: `sft`: supervised training on the data's blocks (the objective above); `opd`: Draft-OPD, on-policy
            refinement of the trained drafter `init_from` names (docs/opd.md): at each anchor the drafter's own
            block, the target's distributions given the draft's tokens, greedy verification's accept mask,
            forward KL on accepted slots and decayed reverse KL on rejected ones. Validation keeps the `sft`
            objective, so the stages compare. Recorded in checkpoints: a resume cannot switch it.
        opd: The `opd` stage's settings (gamma, lambda_acc, lambda_rej, replay, sft_weight).
        init_from: Warm start: a drafter `.ckpt` or exported folder (ours or published) whose weights start this
            run. A drafter may start a run of another variant whose backbone is its own: the parts it lacks
            start at their initialisation (convolutions as the identity, so at step 0 the backbone computes
            what it did), head-only parts it has and the run lacks are dropped (logged). Ignored when a
            checkpoint is resumed.
    """

    stage: Literal["sft", "opd"]
    opd: OPDSettings
    init_from: str | None

    def check(self, drafter: DrafterConfig) -> None:
        """Refuse, before any target or GPU work, a stage and its settings that cannot train together: `opd` settings
        without the stage, the stage without a trained drafter, a variant whose parts cannot be trained on-policy
        (`Part.opd_refusal`, which says why), or a warm start from nothing."""
        stage, opd = self.stage, self.opd
        if stage not in STAGES:
            raise ConfigError(f"model.stage must be one of {STAGES}, got {stage!r}")
        opd.check()
        if stage != "opd" and opd != OPDSettings():
            raise ConfigError(f"model.opd: read only with model.stage=opd (the stage is {stage!r}), so ignored; set "
                              "--model.stage=opd, or drop model.opd")
        if stage == "opd" and not self.init_from:
            raise ConfigError("model.stage=opd refines a trained drafter: name it with model.init_from (a .ckpt or "
                              "exported folder of the supervised stage)")
        for part in drafter.preset.parts if stage == "opd" else ():
            if part.opd_refusal:
                raise ConfigError(f"model.stage=opd: variant {drafter.variant!r} is not trained on-policy here: its "
                                  f"{part.name} part {part.opd_refusal} (docs/opd.md)")


def loss_settings(objective: str, loss_weights: str, dpace_alpha: float, temperature: float) -> LossSettings:
    """The head loss's settings; a value set where nothing reads it is refused, not ignored."""
    try:
        loss = LossSettings(objective, loss_weights, dpace_alpha, temperature)
    except ConfigError as err:
        raise ConfigError(f"model.{err}") from None
    for name, value, needs, now in (("dpace_alpha", dpace_alpha, "loss_weights=dpace", loss_weights == "dpace"),
                                    ("temperature", temperature, "objective=kl or ce+kl", objective != "ce")):
        if value != getattr(LossSettings, name) and not now:  # set, where nothing reads it
            raise ConfigError(f"model.{name}={value}: read only with model.{needs}, so ignored; set that, or drop "
                              f"model.{name}")
    return loss


GROUPS = {"step": StepSettings, "optim": OptimizerSettings, "compile": CompileSettings, "metrics": MetricSettings,
          "nonfinite": NonFiniteSettings, "fp8": FP8Settings, "stage": StageSettings}


@dataclass(frozen=True)
class ModuleSettings:
    """Every setting of a `DFlashModule`, by group; made from its flat arguments by `from_flat`.

    Args:
        target: Hugging Face folder or hub id of the frozen target (linked from `target.path` in the CLI).
        drafter: Drafter shape, variant (a preset of parts) and each part's settings; sizes left unset are the
            target's.
        accept_target_change: Go on (with one logged line) where the checkpoint resumed or validated, or the
            feature cache read, was made with other target weights of the same config (a fine-tune): by default
            refused, as the drafter was trained for, or the features come from, the other weights.
        objective: `ce`: cross-entropy against the data tokens; `kl`: KL(target || drafter), distilling the
            target's own distribution through the same frozen head (needs the whole target forward);
            `ce+kl`: their sum (docs/method.md section 4c).
        loss_weights: Slot weights: `decay`, exp(-(k-1)/gamma); `dpace`, from each step's per-slot CE, how
            much the expected accepted length depends on each slot (docs/method.md section 4b).
        dpace_alpha: D-PACE smoothing alpha in [0, 1]: s_k = (1 - alpha) * q_k + alpha.
        temperature: Distillation temperature: KL of the softmaxes of logits / temperature, times
            temperature**2.
    """

    target: str
    drafter: DrafterConfig
    accept_target_change: bool
    loss: LossSettings
    step: StepSettings
    optim: OptimizerSettings
    compile: CompileSettings
    metrics: MetricSettings
    nonfinite: NonFiniteSettings
    fp8: FP8Settings
    stage: StageSettings

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> ModuleSettings:
        """Group the module's arguments (`model.<name>`), checking every value the user typed before the target's
        config is read: the drafter's, then each group's, then the rules across groups."""
        drafter = values["drafter"]
        check_unused_parts(drafter)
        drafter.check()
        opd = values["opd"]
        values = {**values, "opd": opd if isinstance(opd, OPDSettings) else OPDSettings(**opd),  # a checkpoint's dict
                  "block_size": drafter.block_size}
        groups = {name: kind(**{f.name: values[f.name] for f in fields(kind)}) for name, kind in GROUPS.items()}
        loss = loss_settings(values["objective"], values["loss_weights"], values["dpace_alpha"], values["temperature"])
        settings = cls(values["target"], drafter, values["accept_target_change"], loss, **groups)
        settings.stage.check(drafter)
        settings.check_parts(drafter)  # each part's rules for the run's settings (the target is not needed)
        init_from = settings.stage.init_from
        if init_from and not Path(init_from).exists():  # before any target or GPU work
            raise ConfigError(f"model.init_from: no drafter checkpoint or folder at '{init_from}'")
        return settings

    def check_parts(self, cfg: DrafterConfig, total_steps: float | None = None) -> None:
        """Each part of the preset checks the run's settings (`Part.check_run`): on the drafter as given, and with the
        Trainer's total steps when fitting starts."""
        loss = self.loss
        final = loss.distills or any(p.needs_final_hidden for p in cfg.preset.parts)
        run = RunSettings(loss.objective, loss.loss_weights, cfg.loss_gamma, cfg.gamma is not None, final,
                          total_steps)
        for part in cfg.preset.parts:
            part.check_run(getattr(cfg, part.name), run)

    @property
    def needs_final_hidden(self) -> bool:
        """Whether training reads the target's final hidden states: the objective distills, a part needs them, or
        the stage is `opd` (the teacher of every slot, and a whole target to replay)."""
        return (self.loss.distills or self.stage.stage == "opd"
                or any(p.needs_final_hidden for p in self.drafter.preset.parts))

    def final_hidden_reason(self) -> str:
        """The setting that makes training read the target's final hidden states, named for an error line."""
        if self.stage.stage == "opd":
            return "model.stage 'opd'"
        if self.loss.distills:
            return f"model.objective '{self.loss.objective}'"
        return f"model.drafter.variant '{self.drafter.variant}'"


def args_help(*groups: type) -> str:
    """One `Args:` section of the groups' own: the help (jsonargparse's) of a signature taking their fields flat."""
    sections = (inspect.getdoc(group).partition("Args:\n")[2].rstrip() for group in groups)
    return "\nArgs:\n" + "\n".join(sections)  # the empty first line keeps the entries indented under `Args:`


ARGS_HELP = args_help(ModuleSettings, StepSettings, OptimizerSettings, CompileSettings, MetricSettings,
                      NonFiniteSettings, FP8Settings, StageSettings)
