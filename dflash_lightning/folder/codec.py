"""The drafter folder format as pure functions: a DrafterConfig and its weights <-> config.json's fields and the
tensors by name (docs/method.md section 7). No file is read or written here (`writer.py`, `reader.py` do).

`hf_config` and `folder_tensors` are the way out, `from_folder` (through `config_from_hf`) the way back; each part's
fields go through its hooks (`Part.export_fields`, `top_level_fields`, `present_fields`, `read_fields`,
`convert_folder`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import Tensor

from dflash_lightning.config import ConfigError, DrafterConfig, rope_settings
from dflash_lightning.hf import modeling_dflash
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.presets import ALL_PARTS, DEFAULT_VARIANT, PRESETS, preset
from dflash_lightning.target_model import DTYPES

MODELING_FILE = Path(modeling_dflash.__file__)
"""The modelling file a folder carries (transformers' trust_remote_code classes)."""
REMOTE_CLASSES = modeling_dflash.__all__
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILES = (CONFIG_FILE, MODELING_FILE.name)
# Fields a drafter folder's config.json must have; head_dim and attention_bias have Qwen3 defaults.
REQUIRED_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "rms_norm_eps", "max_position_embeddings", "vocab_size", "num_target_layers", "block_size",
)
DType = Literal["bfloat16", "float16", "float32"]
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Lightning precision -> the dtype the drafter's forward ran in, which is what it is served in.
PRECISION_DTYPES = {
    "bf16-true": "bfloat16", "bf16-mixed": "bfloat16", "bf16": "bfloat16", "16-true": "float16",
    "16-mixed": "float16", "16": "float16", "32-true": "float32", "32": "float32",
}


# --- the way out: DrafterConfig + weights -> config.json + tensors
def hf_config(cfg: DrafterConfig, dtype: DType) -> dict[str, Any]:
    """The config.json of a drafter with weights of `dtype`: Qwen3 fields plus the DFlash ones, as published drafters.

    SGLang builds the drafter in `dtype` under its default `--dtype auto` (float16 without it); vLLM builds it in the
    target's dtype. Sliding layers follow the Qwen3 convention (`layer_types`, `sliding_window`,
    `use_sliding_window`, without which transformers drops the window); `is_causal` is written only when set, as
    the reference reads it. Fields the engines default to this drafter's values are left out
    (use_aux_hidden_state, target_hidden_size, draft_vocab_size, mask_token); docs/method.md section 7.
    """
    layer_types = list(cfg.layer_types or ["full_attention"] * cfg.num_layers)
    sliding = "sliding_attention" in layer_types
    attention = {"use_sliding_window": sliding, "sliding_window": cfg.sliding_window if sliding else None}
    if cfg.is_causal is not None:
        attention["is_causal"] = cfg.is_causal
    preset = cfg.preset  # its architecture name (what vLLM and SGLang pick the loader by) and its parts' fields
    architecture = preset.architecture
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    top_level = {}
    for part in preset.parts:
        dflash |= part.export_fields(getattr(cfg, part.name), cfg)
        top_level |= part.top_level_fields(getattr(cfg, part.name), cfg)
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        # transformers' trust_remote_code class, where the modelling file has one for the architecture
        **({"auto_map": {"AutoModel": f"{MODELING_FILE.stem}.{architecture}"}} if architecture in REMOTE_CLASSES
           else {}),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "layer_types": layer_types,
        **attention,
        "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        **top_level,
        "dflash_config": dflash,
        "dtype": dtype,
    }


def folder_tensors(state: dict[str, Tensor], dtype: DType | None, source: str) -> tuple[dict[str, Tensor], DType]:
    """The tensors a folder saves (cast to `dtype`, None: as they are; on the CPU, contiguous) and their one dtype,
    which config.json's `dtype` names; a cast that overflows, or a mix of dtypes, is refused by name."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in cast_weights(state, dtype, source).items()}
    return tensors, weights_dtype(tensors, source)


def cast_weights(state: dict[str, Tensor], dtype: DType | None, source: str) -> dict[str, Tensor]:
    """Weights cast to `dtype` (None: as they are); a value the cast would turn into inf or nan is refused by name."""
    if dtype is None:
        return state
    out = {}
    for k, v in state.items():
        out[k] = v.to(DTYPES[dtype])
        if v.is_floating_point() and not torch.equal(v.isfinite(), out[k].isfinite()):
            biggest = float(v[v.isfinite()].abs().max())
            raise ValueError(
                f"{source}: '{k}' holds values up to {biggest:.4g}, past the range of {dtype}; keep a wider dtype"
            )
    return out


def weights_dtype(state: dict[str, Tensor], source: str) -> DType:
    """The one floating dtype of a set of weights; a mix is refused (config.json has one `dtype`)."""
    found = {DTYPE_NAMES.get(v.dtype, str(v.dtype)) for v in state.values() if v.is_floating_point()}
    if len(found) != 1 or not found <= set(DTYPES):
        raise ValueError(f"{source}: weights of dtype(s) {sorted(found)}; export needs one of {sorted(DTYPES)}")
    return found.pop()


def served_dtype(cfg: DrafterConfig, dtype: DType | None, precision: str | None) -> DType | None:
    """The folder's dtype: `dtype`, else the one the drafter's parts require (`Part.folder_dtype`: Domino's bf16),
    else the trained one; a `dtype` the parts' engines refuse is refused in one line."""
    required = {part.folder_dtype: part for part in cfg.preset.parts if part.folder_dtype is not None}
    if len(required) > 1:
        raise ConfigError(f"the {cfg.variant} drafter's parts require different dtypes: {sorted(required)}")
    if not required:
        return dtype or PRECISION_DTYPES.get(str(precision))
    (need, part), = required.items()
    if dtype is not None and dtype != need:
        raise ConfigError(f"dtype {dtype}: a {cfg.variant} drafter's folder is served only in {need} (its "
                          f"{part.name} part's engines refuse other weights); export it with dtype {need} or none")
    return need


# --- the way back: config.json + tensors -> DrafterConfig + weights
def from_folder(raw: dict[str, Any], state: dict[str, Tensor], source: str, num_target_layers: int | None = None
                ) -> tuple[DrafterConfig, dict[str, Tensor]]:
    """DrafterConfig and weights of a folder's config.json `raw` and tensors `state` (exported here, published, or
    another trainer's own format that a part converts: `Part.convert_folder`), checked key by key.
    `num_target_layers`: the target's layer count, for a folder that does not record it."""
    for part in ALL_PARTS:
        converted = part.convert_folder(raw, state, source, num_target_layers)
        if converted is not None:
            raw, state = converted
            break
    cfg = config_from_hf(raw)
    check_state_dict(cfg, state, source)
    return cfg, state


def config_from_hf(raw: dict[str, Any]) -> DrafterConfig:
    """The DrafterConfig of a drafter folder's config.json; a missing field is named."""
    missing = [k for k in REQUIRED_FIELDS if raw.get(k) is None]
    dflash = raw.get("dflash_config") or {}
    missing += [f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if dflash.get(k) is None]
    if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        missing.append("rope_theta")
    if missing:
        raise ConfigError(f"drafter config.json lacks required field(s): {', '.join(missing)}")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"drafter config.json: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    # a part's fields in dflash_config, else at the top level (DSpark's, section 12), the order SGLang reads them in
    differ = [k for k in dflash if k in raw and raw[k] != dflash[k]]
    if differ:  # each engine reads one or the other (SGLang refuses Domino's emb_dim so)
        k = differ[0]
        raise ConfigError(f"drafter config.json: dflash_config.{k} ({dflash[k]!r}) and the top-level {k} "
                          f"({raw[k]!r}) differ; the engines read one or the other")
    fields = {**raw, **dflash}
    variant = variant_of_folder(raw.get("architectures"), fields, "drafter config.json")
    stated = raw.get("sample_from_anchor")  # how the engines read a folder's block layout (docs/method.md 12)
    if stated is not None and stated is not preset(variant).layout.anchor_first:
        raise ConfigError(f"drafter config.json: sample_from_anchor {stated!r} is not the block layout of a "
                          f"{preset(variant).architecture} (docs/method.md 3 and 12), which this package trains")
    parts = {part.name: part.read_fields(fields, "drafter config.json") for part in preset(variant).parts}
    rope_theta, rope_scaling = rope_settings(SimpleNamespace(**raw))
    layer_types, window = _attention_fields(raw)
    cfg = DrafterConfig(
        num_layers=raw["num_hidden_layers"], block_size=raw["block_size"], mask_token_id=dflash["mask_token_id"],
        target_layer_ids=list(dflash["target_layer_ids"]), hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        rms_norm_eps=raw["rms_norm_eps"], rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=raw["max_position_embeddings"], vocab_size=raw["vocab_size"],
        num_target_layers=raw["num_target_layers"], attention_bias=bool(raw.get("attention_bias", False)),
        layer_types=layer_types, sliding_window=window,
        is_causal=None if raw.get("is_causal") is None else bool(raw["is_causal"]),
        variant=variant, **parts,
    )
    # gamma is a training choice a folder does not carry; check everything else, naming a part's field as and where
    # the folder has it (dflash_config, or the top level where a part writes its fields there)
    try:
        replace(cfg, gamma=cfg.gamma or 1.0).check()
    except ConfigError as err:
        message = str(err)
        for part in cfg.preset.parts:
            for key, name in part.config_fields.items():
                message = message.replace(f"{part.name}.{name}", f"dflash_config.{key}" if key in dflash else key)
        raise ConfigError(f"drafter config.json: {message}") from err
    return cfg


def variant_of_folder(architectures: Any, dflash: dict[str, Any], source: str) -> str:
    """The variant of a drafter folder's config.json: the preset of its architecture whose parts' dflash_config
    fields it holds (the engines build the parts from those fields and the architecture)."""
    known = list(dict.fromkeys(p.architecture for p in PRESETS.values()))
    architectures = architectures or [PRESETS[DEFAULT_VARIANT].architecture]
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in known:
        raise ConfigError(f"{source}: architectures {architectures} is not one of {[[name] for name in known]}")
    name = architectures[0]
    present = [part for part in ALL_PARTS if part.present_fields(dflash)]  # in the table's order: messages repeat
    candidates = {v: p for v, p in PRESETS.items() if p.architecture == name}
    for variant, p in candidates.items():
        if set(p.parts) == set(present) or (set(present) <= set(p.parts) and len(candidates) == 1):
            missing = [f"dflash_config.{k}" for part in p.parts for k in part.config_fields
                       if dflash.get(k) is None and k not in part.folder_defaults]
            if missing:
                raise ConfigError(f"{source}: a {name} lacks {', '.join(missing)}")
            return variant
    extra = [f"dflash_config.{k}" for part in ALL_PARTS if part in present for k in part.present_fields(dflash)]
    allowed = " or ".join(sorted({", ".join(part.name for part in p.parts) or "none" for p in candidates.values()}))
    raise ConfigError(f"{source}: a {name} has field(s) {', '.join(extra)} of parts it does not have (its parts: "
                      f"{allowed}); set architectures to the variant that has them, or remove them")


def _attention_fields(raw: dict[str, Any]) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) of a config.json as transformers reads them; None, None for all full."""
    layer_types = raw.get("layer_types")
    if not layer_types or set(layer_types) == {"full_attention"}:
        return None, None  # all full: a stored sliding_window is unused, as in transformers
    if "sliding_attention" not in layer_types:
        return list(layer_types), None  # unknown types: DrafterConfig.check names them
    if raw.get("use_sliding_window") is False:
        raise ConfigError("drafter config.json: layer_types has sliding_attention layers but use_sliding_window "
                          "is false, so transformers and the engines drop sliding_window; set it true")
    return list(layer_types), raw.get("sliding_window")


def check_state_dict(cfg: DrafterConfig, state: dict[str, Tensor], source: str) -> None:
    """Refuse weights that are not exactly the drafter's: each missing, extra or wrong-shaped key is named."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).state_dict().items()}
    problems = [f"missing '{k}' {list(s)}" for k, s in expected.items() if k not in state]
    problems += [f"unexpected '{k}' {list(v.shape)}" for k, v in state.items() if k not in expected]
    problems += [
        f"'{k}' has shape {list(v.shape)}, the config implies {list(expected[k])}"
        for k, v in state.items() if k in expected and tuple(v.shape) != expected[k]
    ]
    if problems:
        raise ValueError(f"{source}: weights do not match the drafter config: " + "; ".join(problems))


__all__ = [
    "CONFIG_FILE", "CONFIG_FILES", "DTYPE_NAMES", "MODELING_FILE", "PRECISION_DTYPES", "REMOTE_CLASSES",
    "REQUIRED_FIELDS", "WEIGHTS_FILE", "DType", "cast_weights", "check_state_dict", "config_from_hf", "folder_tensors",
    "from_folder", "hf_config", "served_dtype", "variant_of_folder", "weights_dtype",
]
