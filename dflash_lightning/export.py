"""Export a trained drafter as the Hugging Face folder inference engines load (DFLASH.md section 7), and back.

`export_checkpoint` writes config.json, model.safetensors and the modelling file; `import_folder` reads such
a folder (ours or a published one) for fine-tuning or evaluation; `load_drafter` loads either for evaluation.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import Tensor

from dflash_lightning.checkpointing import CheckpointError, load_checkpoint, nonfinite_weights
from dflash_lightning.config import ConfigError, DrafterConfig, _rope_settings
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.target import DTYPES, load_target_config, load_target_io, weight_map

MODELING_FILE = Path(__file__).parent / "hf" / "modeling_dflash.py"
# Fields a drafter folder's config.json must have; head_dim and attention_bias have Qwen3 defaults.
REQUIRED_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "rms_norm_eps", "max_position_embeddings", "vocab_size", "num_target_layers", "block_size",
)


def hf_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The config.json of a drafter: Qwen3 fields plus the DFlash ones, as published drafters have them.

    Sliding layers follow the Qwen3 convention (`layer_types`, `sliding_window`, `use_sliding_window`, without
    which transformers drops the window); `is_causal` is written only when set, as the reference reads it.
    """
    layer_types = list(cfg.layer_types or ["full_attention"] * cfg.num_layers)
    sliding = "sliding_attention" in layer_types
    attention = {"use_sliding_window": sliding, "sliding_window": cfg.sliding_window if sliding else None}
    if cfg.is_causal is not None:
        attention["is_causal"] = cfg.is_causal
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": f"{MODELING_FILE.stem}.DFlashDraftModel"},
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
        "tie_word_embeddings": False,
        "layer_types": layer_types,
        **attention,
        "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }


def config_from_hf(raw: dict[str, Any]) -> DrafterConfig:
    """The DrafterConfig of a drafter folder's config.json; a missing field is named."""
    missing = [k for k in REQUIRED_FIELDS if raw.get(k) is None]
    dflash = raw.get("dflash_config") or {}
    missing += [f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if dflash.get(k) is None]
    if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        missing.append("rope_theta")
    if missing:
        raise ConfigError(f"drafter config.json lacks required field(s): {', '.join(missing)}")
    rope_theta, rope_scaling = _rope_settings(SimpleNamespace(**raw))
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
    )
    # gamma is a training choice a folder does not carry; check everything else.
    replace(cfg, gamma=cfg.gamma or 1.0).check()
    return cfg


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


def read_checkpoint(path: str | Path) -> tuple[DrafterConfig, dict[str, Tensor], str | None]:
    """Drafter config, drafter weights (no `drafter.` prefix) and target path of a Lightning checkpoint."""
    # weights_only=False: the hyper-parameters hold a DrafterConfig object; the file is the user's own.
    ckpt = load_checkpoint(path, weights_only=False, required=("state_dict", "drafter_config"))
    cfg = DrafterConfig(**ckpt["drafter_config"])
    prefix = "drafter."
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    check_state_dict(cfg, state, str(path))
    bad = nonfinite_weights(state)
    if bad:  # written before saves refused them, or by other code: such weights draft nothing
        names = ", ".join(f"{k} ({n})" for k, n in list(bad.items())[:4])
        raise CheckpointError(f"{path}: non-finite weights (NaN/Inf values in {len(bad)} tensors: {names})")
    return cfg, state, (ckpt.get("hyper_parameters") or {}).get("target")


def export_checkpoint(
    ckpt_path: str | Path, out_dir: str | Path, dtype: Literal["bfloat16", "float16", "float32"] | None = None
) -> Path:
    """Write config.json, model.safetensors and the modelling file of a Lightning checkpoint to `out_dir`."""
    cfg, state, _ = read_checkpoint(ckpt_path)
    return write_folder(cfg, state, out_dir, dtype)


def write_folder(
    cfg: DrafterConfig, state: dict[str, Tensor], out_dir: str | Path,
    dtype: Literal["bfloat16", "float16", "float32"] | None = None,
) -> Path:
    """The Hugging Face folder of a drafter config and its weights (names as in `DFlashDrafter.state_dict`)."""
    from safetensors.torch import save_file

    check_state_dict(cfg, state, "export")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(DTYPES[dtype]) if dtype else v).detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    shutil.copyfile(MODELING_FILE, out / MODELING_FILE.name)
    return out


def import_folder(folder: str | Path) -> tuple[DrafterConfig, dict[str, Tensor]]:
    """DrafterConfig and weights of a drafter folder (exported here or published), checked key by key."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{folder}: no config.json")
    cfg = config_from_hf(json.loads(config_file.read_text()))
    state: dict[str, Tensor] = {}
    for name in sorted(set(weight_map(folder).values())):
        state.update(load_file(folder / name))
    check_state_dict(cfg, state, str(folder))
    return cfg, state


def read_drafter(path: str | Path) -> tuple[DrafterConfig, dict[str, Tensor], str | None]:
    """Config, weights and (for a checkpoint) target path of a Lightning `.ckpt` or an exported folder."""
    path = Path(path)
    if path.is_dir():
        return (*import_folder(path), None)
    if not path.exists():
        raise FileNotFoundError(f"no drafter checkpoint or folder at '{path}'")
    return read_checkpoint(path)


def build_drafter(cfg: DrafterConfig, state: dict[str, Tensor], target: str) -> DFlashDrafter:
    """A drafter with these weights and the target's embedding and head, after checking it fits the target."""
    target_layers = load_target_config(target).num_hidden_layers
    if target_layers != cfg.num_target_layers:
        raise ConfigError(
            f"the drafter was made for a target of {cfg.num_target_layers} layers, '{target}' has {target_layers}"
        )
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state)
    drafter.set_target_io(*load_target_io(target))  # checks hidden_size and vocab_size against the target
    return drafter.eval()


def load_drafter(path: str | Path, target_path: str | None = None) -> DFlashDrafter:
    """A drafter from a Lightning `.ckpt` or an exported folder, with the target's embedding and head attached.

    `target_path` may be left out for a checkpoint, whose hyper-parameters name its target.
    """
    cfg, state, ckpt_target = read_drafter(path)
    target = target_path or ckpt_target
    if target is None:
        raise ValueError(f"{path}: give the target (its embedding and head are not part of the drafter)")
    return build_drafter(cfg, state, target)


def export(*, checkpoint: str, out: str, dtype: Literal["bfloat16", "float16", "float32"] | None = None) -> Path:
    """Export a DFlashModule checkpoint as a Hugging Face folder for vLLM, SGLang and transformers.

    Args:
        checkpoint: Lightning `.ckpt` file written while training a DFlashModule.
        out: Folder to write config.json, model.safetensors and modeling_dflash.py to.
        dtype: Dtype of the saved weights; None: as stored in the checkpoint.
    """
    folder = export_checkpoint(checkpoint, out, dtype)
    print(f"exported {checkpoint} -> {folder}")
    return folder


__all__ = [
    "build_drafter", "check_state_dict", "export_checkpoint", "hf_config", "import_folder", "load_drafter",
    "read_checkpoint", "read_drafter", "write_folder",
]
