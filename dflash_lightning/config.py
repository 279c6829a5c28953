"""The drafter's configuration and how it is derived from the target's (docs/method.md sections 1, 2, 7b).

Every size the drafter shares with the target is read from the target's config unless set here.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal

from dflash_lightning.blocks import BlockLayout
from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.convolutions import ConvSettings
from dflash_lightning.parts.domino import DominoSettings
from dflash_lightning.parts.dspark import DSparkSettings
from dflash_lightning.parts.lilicorr import LiLiCorrSettings
from dflash_lightning.parts.presets import ALL_PARTS, DEFAULT_VARIANT, PRESETS, Preset, preset
from dflash_lightning.parts.selector import SelectorSettings
from dflash_lightning.parts.xpress import XPressSettings

# Attention types of a drafter layer, named as config.json's `layer_types` names them (docs/method.md section 3b).
LAYER_TYPES = ("full_attention", "sliding_attention")
# Drafter variants: the presets of parts (parts/presets.py).
VARIANTS = tuple(PRESETS)
# Settings field -> its dataclass: each part's, nested under the drafter's config (one DrafterConfig field each).
PART_SETTINGS = {part.name: part.settings_type for part in ALL_PARTS}
# Flat fields of drafter configs written before parts had their own settings -> their place now (`Part.legacy_fields`).
LEGACY_FIELDS = {old: (part.name, new) for part in ALL_PARTS for old, new in part.legacy_fields.items()}
# Run-record keys of those (and of other older keys, `Part.legacy_record`) -> their keys now.
LEGACY_RECORD = {f"drafter.{old}": f"drafter.{part}.{name}" for old, (part, name) in LEGACY_FIELDS.items()} | {
    old: f"drafter.{part.name}.{new}" for part in ALL_PARTS for old, new in part.legacy_record.items()}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter: `[L // 2]` for one layer, else spread over 1..L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """Shape of a DFlash drafter; fields left None are copied from the target's config."""

    num_layers: int = 1
    """Number of drafter decoder layers (n); also the number of target layers used unless ids are given."""
    block_size: int = 16
    """Tokens per drafted block (B): the anchor token plus B-1 masked slots."""
    mask_token_id: int | None = None
    """Embedding row used as MASK; None: the first row past the tokenizer's tokens."""
    target_layer_ids: list[int] | None = None
    """Target decoder layers whose outputs form the context feature; None: the DFlash default spread."""
    gamma: float | None = None
    """Loss decay over slots, w_k = exp(-(k-1)/gamma) (anchor-first blocks: exp(-k/gamma)); None: the block
    layout's default, 7 for B=16, 5 for B=10, 4 for B=8 (dspark and xpress: 4, domino: 7)."""
    hidden_size: int | None = None
    """Drafter width H; must equal the target's (the head and embedding are the target's)."""
    intermediate_size: int | None = None
    """MLP width; None: the target's."""
    num_attention_heads: int | None = None
    """Query heads; None: the target's."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); None: the target's."""
    head_dim: int | None = None
    """Per-head width; None: the target's (or hidden_size // heads)."""
    rms_norm_eps: float | None = None
    """RMSNorm epsilon; None: the target's."""
    rope_theta: float | None = None
    """RoPE base; None: the target's."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling dict (llama3, yarn, linear, ...); None: the target's."""
    max_position_embeddings: int | None = None
    """Longest position the RoPE tables cover; None: the target's."""
    vocab_size: int | None = None
    """Rows of the target's embedding and head; None: the target's."""
    num_target_layers: int | None = None
    """Decoder layers of the target (L); None: the target's."""
    attention_bias: bool = False
    """Bias on q/k/v/o projections (Qwen3: no)."""
    layer_types: list[str] | None = None
    """Attention of each drafter layer, `full_attention` or `sliding_attention` (docs/method.md 3b); None: all full."""
    sliding_window: int | None = None
    """Window W of sliding layers: slot i of an anchor p sees context j of its document with (p+i) - j < W."""
    is_causal: bool | None = None
    """Causal attention inside the block; None: sliding layers causal, full layers bidirectional (the reference's
    default); true or false: every layer."""

    variant: Literal[VARIANTS] = DEFAULT_VARIANT  # type: ignore[valid-type]
    """The preset of parts on the DFlash backbone (docs/parts.md): `dflash`; `dflash2`, + block convolutions and a
    candidate selector (docs/method.md 10); `lilicorr`, + a candidate-lattice reranker (section 11);
    `lilicorr-conv`, + the reranker and the block convolutions; `dspark`, anchor-first blocks + Markov and confidence
    heads (section 12); `domino`, anchor-first blocks + a GRU prefix correction of the logits (section 13); `xpress`,
    + a causal low-rank refiner resolved by Jacobi passes (section 14). A part's
    settings below are read only by a variant that has the part; one given another value than its default under a
    variant without the part is refused (docs/parts.md)."""
    conv: ConvSettings = field(default_factory=ConvSettings)
    """Block convolutions (dflash2, lilicorr-conv)."""
    selector: SelectorSettings = field(default_factory=SelectorSettings)
    """Candidate selector (dflash2)."""
    lilicorr: LiLiCorrSettings = field(default_factory=LiLiCorrSettings)
    """Candidate-lattice reranker (lilicorr, lilicorr-conv)."""
    dspark_heads: DSparkSettings = field(default_factory=DSparkSettings)
    """Markov and confidence heads (dspark)."""
    domino: DominoSettings = field(default_factory=DominoSettings)
    """GRU prefix correction and its base-to-final loss curriculum (domino)."""
    xpress: XPressSettings = field(default_factory=XPressSettings)
    """Causal low-rank refiner and its Jacobi decoding (xpress)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle a config of any version (a checkpoint's hyper-parameters), the flat fields of old ones moved."""
        self.__dict__.update(upgrade_fields(state))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DrafterConfig:
        """A config from `to_dict`'s output (a checkpoint's `drafter_config`, of this version or an older one)."""
        values = upgrade_fields(values)
        return cls(**{k: PART_SETTINGS[k](**v) if k in PART_SETTINGS and isinstance(v, dict) else v
                      for k, v in values.items()})

    @property
    def preset(self) -> Preset:
        """The variant's preset: its parts, architecture name and serve commands."""
        return preset(self.variant)

    @property
    def layout(self) -> BlockLayout:
        """The block layout of the variant (`blocks.BlockLayout`, from its parts): which position each slot
        predicts, which slots train and draft."""
        return self.preset.layout

    def resolved(
        self, target_config: Any, tokenizer_len: int | None = None, mask_ids: list[int] | tuple = ()
    ) -> DrafterConfig:
        """Fill every None from the target's Hugging Face config and check the result.

        `mask_ids` are the special tokens nothing writes (`target_model.mask_candidates`: Llama 3's reserved ones,
        SmolLM2's unused ones), in the order MASK takes them when the embedding has no row past the tokenizer's.
        """
        tc = target_config
        text = getattr(tc, "text_config", None) or tc  # multimodal targets keep the LM config inside
        rope_theta, rope_scaling = rope_settings(text)
        heads = self.num_attention_heads or text.num_attention_heads
        values = dict(
            hidden_size=self.hidden_size or text.hidden_size,
            intermediate_size=self.intermediate_size or text.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=self.num_key_value_heads or getattr(text, "num_key_value_heads", None) or heads,
            head_dim=self.head_dim or getattr(text, "head_dim", None) or text.hidden_size // heads,
            rms_norm_eps=self.rms_norm_eps or getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=self.rope_theta or rope_theta,
            rope_scaling=self.rope_scaling if self.rope_scaling is not None else rope_scaling,
            max_position_embeddings=self.max_position_embeddings or text.max_position_embeddings,
            vocab_size=self.vocab_size or text.vocab_size,
            num_target_layers=self.num_target_layers or text.num_hidden_layers,
        )
        out = DrafterConfig(**{**{f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}, **values})
        if out.hidden_size != text.hidden_size:
            raise ConfigError(
                f"drafter hidden_size ({out.hidden_size}) must equal the target's hidden_size "
                f"({text.hidden_size}): the drafter uses the target's embedding and head"
            )
        if out.vocab_size != text.vocab_size:
            raise ConfigError(f"vocab_size ({out.vocab_size}) must equal the target's ({text.vocab_size})")
        if out.target_layer_ids is None:
            out.target_layer_ids = default_target_layer_ids(out.num_target_layers, out.num_layers)
        if out.mask_token_id is None:
            if tokenizer_len is not None and tokenizer_len < out.vocab_size:
                out.mask_token_id = tokenizer_len  # the first row past the tokenizer's tokens
            elif mask_ids:
                out.mask_token_id = mask_ids[0]
            else:
                raise ConfigError(
                    f"mask_token_id: the tokenizer has {tokenizer_len} tokens and the embedding {out.vocab_size} "
                    "rows, and no special token that neither the chat template nor the tokenizer's named tokens "
                    "write, so no row can be MASK; set model.drafter.mask_token_id to a row no data token uses"
                )
        out.check(tokenizer_len, mask_ids)
        return out

    def check(self, tokenizer_len: int | None = None, mask_ids: list[int] | tuple = ()) -> None:
        """Raise ConfigError naming the field of any value that cannot work."""
        if self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2 (an anchor and one drafted slot), got {self.block_size}")
        if self.gamma is None and self.layout.default_gamma(self.block_size) is None:
            raise ConfigError(f"gamma: no default for block_size {self.block_size}; set gamma")
        if self.gamma is not None and self.gamma <= 0:
            raise ConfigError(f"gamma must be > 0, got {self.gamma}")
        if self.num_target_layers is not None and self.target_layer_ids is not None:
            if not self.target_layer_ids:
                raise ConfigError("target_layer_ids must not be empty")
            bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
            if bad:
                raise ConfigError(
                    f"target_layer_ids {bad} out of range: the target has {self.num_target_layers} "
                    f"layers (valid ids 0..{self.num_target_layers - 1})"
                )
            last = self.num_target_layers - 1
            if last in self.target_layer_ids:
                raise ConfigError(
                    f"target_layer_ids {list(self.target_layer_ids)} name the target's last layer ({last}): the "
                    "engines disagree about its feature (Hugging Face and the reference take the final norm's "
                    "output, vLLM the residual stream before it, SGLang's Qwen3 and Llama never capture it), so "
                    f"such a drafter serves differently in each (docs/method.md section 1); use ids up to {last - 1}"
                )
        if self.mask_token_id is not None and self.vocab_size is not None:
            if not 0 <= self.mask_token_id < self.vocab_size:
                raise ConfigError(
                    f"mask_token_id {self.mask_token_id} is outside the target's embedding "
                    f"(vocab_size {self.vocab_size})"
                )
            emitted = tokenizer_len is not None and self.mask_token_id < tokenizer_len
            if emitted and self.mask_token_id not in mask_ids:
                if tokenizer_len < self.vocab_size:
                    instead = f"use a row past them, e.g. {tokenizer_len}"
                elif mask_ids:
                    instead = f"use a special token nothing writes, e.g. {mask_ids[0]} (docs/method.md section 3)"
                else:
                    instead = "the embedding has no row past them and no special token nothing writes"
                raise ConfigError(
                    f"mask_token_id {self.mask_token_id} is a token the tokenizer emits (it has {tokenizer_len} "
                    f"tokens, and it is not a special token that neither the chat template nor the tokenizer's "
                    f"named tokens write); {instead}"
                )
        self._check_layer_types()
        self._check_variant()
        if self.hidden_size is not None and self.num_attention_heads is not None:
            if self.num_attention_heads % (self.num_key_value_heads or self.num_attention_heads):
                raise ConfigError(
                    f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"num_key_value_heads ({self.num_key_value_heads})"
                )

    def _check_layer_types(self) -> None:
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries, the drafter has num_layers={self.num_layers}"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ConfigError(f"layer_types: unknown type(s) {bad}; use {' or '.join(LAYER_TYPES)}")
        sliding = "sliding_attention" in (self.layer_types or ())
        if sliding and (self.sliding_window is None or self.sliding_window < 1):
            raise ConfigError(f"sliding_window must be >= 1 for sliding_attention layers, got {self.sliding_window}")
        if not sliding and self.sliding_window is not None:
            raise ConfigError(
                f"sliding_window ({self.sliding_window}) is set but no layer is sliding_attention: set layer_types"
            )

    def _check_variant(self) -> None:
        for part in self.preset.parts:  # a part's settings are checked where the variant has the part
            settings = getattr(self, part.name)
            for f in fields(settings):  # every part's numbers: NaN and inf train nothing
                value = getattr(settings, f.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ConfigError(f"{part.name}.{f.name} must be a finite number, got {value}")
            settings.check(self)

    def attention_rule(self, layer: int) -> tuple[int | None, bool]:
        """(window W or None, causal inside the block) of a drafter layer: the mask it attends under."""
        sliding = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return (self.sliding_window if sliding else None), causal

    @property
    def num_context_layers(self) -> int:
        """K: how many target layers are concatenated into one context feature."""
        assert self.target_layer_ids is not None, "resolve the config against a target first"
        return len(self.target_layer_ids)

    @property
    def loss_gamma(self) -> float:
        """Gamma of the slot weights, with the block layout's default."""
        return self.gamma if self.gamma is not None else self.layout.default_gamma(self.block_size)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field, a part's settings as a dict (for checkpoints; `from_dict` reads it back)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def flat_dict(self) -> dict[str, Any]:
        """Every field as `name` or `part.field` -> value (the run record's keys)."""
        out = {}
        for name, value in self.to_dict().items():
            if name in PART_SETTINGS:
                out |= {f"{name}.{k}": v for k, v in value.items()}
            else:
                out[name] = value
        return out

    def training_fields(self) -> list[str]:
        """Fields that are training choices a drafter's weights do not depend on (gamma, parts' loss weights)."""
        out = ["gamma"]
        for part in self.preset.parts:
            shape = set(part.config_fields.values())
            out += [f"{part.name}.{f.name}" for f in fields(getattr(self, part.name)) if f.name not in shape]
        return out


class UnusedPartSettings(ConfigError):
    """A part's setting given where the variant lacks the part (`variant`: the variant that lacks it)."""

    def __init__(self, message: str, variant: str) -> None:
        super().__init__(message)
        self.variant = variant


def check_unused_parts(config: DrafterConfig) -> None:
    """Refuse a part's setting given a value other than its default where the variant lacks the part (it would be
    ignored), naming the setting and the variants that have the part. Checked where a user sets them (the module),
    not on checkpoints or folders."""
    for part in ALL_PARTS:
        if part in config.preset.parts:
            continue
        settings, defaults = getattr(config, part.name), part.settings_type()
        changed = [f.name for f in fields(settings) if getattr(settings, f.name) != getattr(defaults, f.name)]
        if not changed:
            continue
        key = f"model.drafter.{part.name}."
        given = ", ".join(f"{key}{name}={getattr(settings, name)}" for name in changed)
        default = ", ".join(f"{key}{name}={getattr(defaults, name)}" for name in changed)
        users = ", ".join(v for v, p in PRESETS.items() if part in p.parts)
        raise UnusedPartSettings(
            f"{given}: variant '{config.variant}' has no {part.name} part, so {'it' if len(changed) == 1 else 'they'}"
            f" would be ignored; the variants with it: {users}. Set model.drafter.variant to one of those, or drop "
            f"the setting{'s' if len(changed) > 1 else ''} from the config and command line (or override with the "
            f"default: {default})", config.variant)


def _plain(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) else value


def upgrade_record(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """A checkpoint's run record (`drafter.<field>` ...) with the keys of an older version's flat part fields moved."""
    if record is None or not any(k in LEGACY_RECORD for k in record):
        return record
    return {LEGACY_RECORD.get(k, k): v for k, v in record.items()}


def upgrade_fields(values: dict[str, Any]) -> dict[str, Any]:
    """A drafter config's fields with the flat part fields of configs written before parts (`conv_kernel_size`
    ...) moved into the parts' settings; a config of this version comes back as it is."""
    if not any(k in LEGACY_FIELDS for k in values):
        return values
    out = {k: v for k, v in values.items() if k not in LEGACY_FIELDS}
    for old, (part, name) in LEGACY_FIELDS.items():
        if old in values:
            settings = out.get(part)
            settings = asdict(settings) if is_dataclass(settings) else dict(settings or {})
            out[part] = {**settings, name: values[old]}
    for part, kind in PART_SETTINGS.items():
        if isinstance(out.get(part), dict):
            out[part] = kind(**out[part])
    return out


def rope_settings(text_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a config of either transformers 4 or 5 style."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return theta, scaling
    theta = float(getattr(text_config, "rope_theta", 10000.0))
    scaling = getattr(text_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, (dict(scaling) if scaling else None)


__all__ = [
    "VARIANTS", "ConfigError", "DrafterConfig", "UnusedPartSettings", "check_unused_parts", "default_target_layer_ids",
    "rope_settings", "upgrade_fields", "upgrade_record",
]
