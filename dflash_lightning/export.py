"""Export a trained drafter as the Hugging Face folder inference engines load (docs/method.md section 7), and back.

`export_checkpoint` writes config.json (with the weights' `dtype`), model.safetensors and the modelling file, all or
nothing (`replace_folder`);
`serve_commands` are the vLLM and SGLang commands for the folder; `import_folder` reads such a folder (ours or a
published one) for fine-tuning or evaluation; `load_drafter` loads either for evaluation.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import Tensor

from dflash_lightning.config import ConfigError, DrafterConfig, _rope_settings
from dflash_lightning.decoding.calibration import fits_for, fold, pick_temperature, read_calibration
from dflash_lightning.hf.modeling_dflash import __all__ as REMOTE_CLASSES
from dflash_lightning.long_runs.atomic import write_dir_atomic
from dflash_lightning.long_runs.checkpointing import CheckpointError, load_checkpoint, nonfinite_weights
from dflash_lightning.long_runs.distributed_checkpoint import is_distributed_checkpoint
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.presets import ALL_PARTS, preset, variant_of_folder
from dflash_lightning.target_model import DTYPES, load_target_config, load_target_io, weight_map

log = logging.getLogger(__name__)

MODELING_FILE = Path(__file__).parent / "hf" / "modeling_dflash.py"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILES = ("config.json", MODELING_FILE.name)
# What an existing folder may hold that engines or transformers load as weights (with `*.index.json`).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TMP_SUFFIX = ".tmp"  # `.{name}.{pid}.tmp` beside the folder while it is written
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


class ExportError(CheckpointError):
    """A drafter folder that cannot be written; the message is one line that starts with the folder."""


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


def serve_commands(folder: str | Path, cfg: DrafterConfig, target: str | None = None) -> dict[str, str]:
    """The vLLM and SGLang commands that serve a drafter folder for its target, with the trained block size; an
    engine without a runtime for the preset (`Preset.vllm_method` or `sglang_algorithm` None) has none.

    vLLM never reads a DFlash `block_size`: its block is 1 + `num_speculative_tokens`, so that is set to the drafts
    of a block (`BlockLayout.drafts`: B - 1, DSpark's anchor-first block B), with the parts' own keys
    (`Part.speculative_config`). SGLang reads `block_size` itself; its `--speculative-<algorithm>-block-size` flag
    states it anyway, so the command says what is served.
    """
    model = shlex.quote(str(target)) if target else "TARGET_MODEL"
    preset, commands = cfg.preset, {}
    if preset.vllm_method is not None:
        spec = {"method": preset.vllm_method, "model": str(folder),
                "num_speculative_tokens": cfg.layout.drafts(cfg.block_size)}
        for part in preset.parts:
            spec |= part.speculative_config(getattr(cfg, part.name))
        commands["vllm"] = f"vllm serve {model} --speculative-config {shlex.quote(json.dumps(spec))}"
    algorithm = preset.sglang_algorithm
    if algorithm is not None:
        draft = shlex.quote(str(folder))
        flags = [flag for part in preset.parts for flag in part.sglang_args(getattr(cfg, part.name))]
        commands["sglang"] = " ".join([
            f"python -m sglang.launch_server --model-path {model} --speculative-algorithm {algorithm}",
            f"--speculative-draft-model-path {draft} --speculative-{algorithm.lower()}-block-size {cfg.block_size}",
            *flags])
    return commands


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
    cfg, state, target, _ = _read_checkpoint(path)
    return cfg, state, target


def _read_checkpoint(path: str | Path) -> tuple[DrafterConfig, dict[str, Tensor], str | None, str | None]:
    """`read_checkpoint` plus the Lightning precision the checkpoint was trained at (None if not recorded)."""
    # weights_only=False: the hyper-parameters hold a DrafterConfig object; the file is the user's own.
    ckpt = load_checkpoint(path, weights_only=False, required=("state_dict", "drafter_config"))
    cfg = DrafterConfig.from_dict(ckpt["drafter_config"])  # of this version, or flat part fields of an older one
    try:
        cfg.check()
    except ConfigError as err:
        raise ConfigError(f"{path}: drafter_config: {err}") from err
    prefix = "drafter."
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    check_state_dict(cfg, state, str(path))
    bad = nonfinite_weights(state)
    if bad:  # written before saves refused them, or by other code: such weights draft nothing
        names = ", ".join(f"{k} ({n})" for k, n in list(bad.items())[:4])
        raise CheckpointError(f"{path}: non-finite weights (NaN/Inf values in {len(bad)} tensors: {names})")
    return cfg, state, (ckpt.get("hyper_parameters") or {}).get("target"), ckpt.get("precision")


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, dtype: DType | None = None) -> Path:
    """Write config.json, model.safetensors and the modelling file of a Lightning checkpoint to `out_dir`.

    `dtype` None: the dtype the drafter was trained in (bf16-true and bf16-mixed: bfloat16), else as stored.
    """
    cfg, state, _, precision = _read_checkpoint(ckpt_path)  # config and weights checked there, once
    return _write_checked(cfg, state, out_dir, served_dtype(cfg, dtype, precision))[0]


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


def write_folder(cfg: DrafterConfig, state: dict[str, Tensor], out_dir: str | Path, dtype: DType | None = None) -> Path:
    """The Hugging Face folder of a drafter config and its weights (names as in `DFlashDrafter.state_dict`).

    `dtype` casts the saved weights, and config.json's `dtype` names what was saved; None keeps them as they are.
    """
    cfg.check()
    check_state_dict(cfg, state, "export")
    return _write_checked(cfg, state, out_dir, dtype)[0]


def _write_checked(cfg: DrafterConfig, state: dict[str, Tensor], out_dir: str | Path, dtype: DType | None
                   ) -> tuple[Path, DType]:
    """`write_folder` of a config and weights already checked; returns the folder and the dtype saved.

    The cast is refused (by weight name) before anything is written.
    """
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in cast_weights(state, dtype, "export").items()}
    saved = weights_dtype(tensors, "export")

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        _config_files(cfg, tmp, saved)

    out = Path(out_dir)
    replace_folder(out, write, {WEIGHTS_FILE, *CONFIG_FILES})
    return out, saved


def write_config(cfg: DrafterConfig, out_dir: str | Path, dtype: DType) -> Path:
    """config.json and the modelling file of a drafter folder (`write_folder` adds the weights)."""
    cfg.check()
    out = Path(out_dir)
    replace_folder(out, lambda tmp: _config_files(cfg, tmp, dtype), set(CONFIG_FILES))
    return out


def _config_files(cfg: DrafterConfig, out: Path, dtype: DType) -> None:
    """config.json and the modelling file of a config already checked, written into `out`."""
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    shutil.copyfile(MODELING_FILE, out / MODELING_FILE.name)


def replace_folder(out: Path, write: Callable[[Path], None], names: set[str]) -> None:
    """Write the drafter folder `out` all or nothing: `write(tmp)` writes the files `names`, the folder's other
    files are carried over (hard links), and the whole is put in place in one step (`write_dir_atomic`).

    Weight files the write does not replace (other shards, an index, `.bin`) are refused, naming them: engines
    would load them with, or instead of, the new weights, and deleting them would lose them.
    """
    out = Path(os.path.abspath(out.resolve() if out.is_symlink() else out))  # "." and ".." name a folder too
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise ExportError(f"{out}: is the current folder or holds it; the export replaces the folder whole, which "
                          "would leave this shell in a deleted one: run it from outside the folder")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    kept = sorted(p for p in out.iterdir() if p.name not in names) if out.is_dir() else []
    stale = [p.name for p in kept if p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json")]
    if stale:
        raise ExportError(f"{out}: holds weight files this export does not write: {', '.join(stale)}; engines "
                          "would load them too, so move them away or export to another folder")
    for leftover in out.parent.glob(f".{glob.escape(out.name)}.*{TMP_SUFFIX}"):
        log.warning(f"{leftover}: left by an export that did not finish; never read, safe to delete")
    for leftover in out.parent.glob(f".{glob.escape(out.name)}.*.old"):
        log.warning(f"{leftover}: a complete earlier {out.name}, moved aside by an export that did not finish")

    def write_all(tmp: Path) -> None:
        write(tmp)
        for path in kept:
            _carry_over(path, tmp / path.name)

    try:
        write_dir_atomic(out, write_all, suffix=TMP_SUFFIX)
    except OSError as err:
        raise ExportError(f"{out}: export failed, the folder is as it was: {err}") from err


def _carry_over(src: Path, dst: Path) -> None:
    """A file, symlink or folder of the old drafter folder, in the new one: hard links where the filesystem allows."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    """A hard link of `src` at `dst` (no copy of the data), or a copy where linking is refused."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst)


def import_folder(folder: str | Path, num_target_layers: int | None = None) -> tuple[DrafterConfig, dict[str, Tensor]]:
    """DrafterConfig and weights of a drafter folder (exported here, published, or another trainer's own format that a
    part converts: `Part.convert_folder`), checked key by key. `num_target_layers`: the target's layer count, for
    a folder that does not record it."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{folder}: no config.json")
    raw = json.loads(config_file.read_text())
    state: dict[str, Tensor] = {}
    for name in sorted(set(weight_map(folder).values())):
        state.update(load_file(folder / name))
    for part in ALL_PARTS:
        converted = part.convert_folder(raw, state, str(folder), num_target_layers)
        if converted is not None:
            raw, state = converted
            break
    cfg = config_from_hf(raw)
    check_state_dict(cfg, state, str(folder))
    return cfg, state


def read_drafter(path: str | Path, num_target_layers: int | None = None
                 ) -> tuple[DrafterConfig, dict[str, Tensor], str | None]:
    """Config, weights and (for a checkpoint) target path of a Lightning `.ckpt` or an exported folder
    (`num_target_layers`: the target's layer count, for a folder that does not record it)."""
    path = Path(path)
    if path.is_dir() and not is_distributed_checkpoint(path):
        return (*import_folder(path, num_target_layers), None)
    if not path.exists():
        raise FileNotFoundError(f"no drafter checkpoint or folder at '{path}'")
    return read_checkpoint(path)


def build_drafter(cfg: DrafterConfig, state: dict[str, Tensor], target: str, dtype: DType | None = None
                  ) -> DFlashDrafter:
    """A drafter with these weights (cast to `dtype`, as engines cast a folder to the served dtype) and the target's
    embedding and head, after checking it fits the target."""
    target_layers = load_target_config(target).num_hidden_layers
    if target_layers != cfg.num_target_layers:
        raise ConfigError(
            f"the drafter was made for a target of {cfg.num_target_layers} layers, '{target}' has {target_layers}"
        )
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(cast_weights(state, dtype, "drafter"))
    drafter.set_target_io(*load_target_io(target))  # checks hidden_size and vocab_size against the target
    return drafter.eval() if dtype is None else drafter.to(DTYPES[dtype]).eval()


def load_drafter(path: str | Path, target_path: str | None = None) -> DFlashDrafter:
    """A drafter from a Lightning `.ckpt` or an exported folder, with the target's embedding and head attached.

    `target_path` may be left out for a checkpoint, whose hyper-parameters name its target.
    """
    cfg, state, ckpt_target = read_drafter(path)
    target = target_path or ckpt_target
    if target is None:
        raise ValueError(f"{path}: give the target (its embedding and head are not part of the drafter)")
    return build_drafter(cfg, state, target)


def export(*, checkpoint: str, out: str, dtype: DType | None = None, calibration: str | None = None,
           calibration_temperature: float | None = None) -> Path:
    """Export a DFlashModule checkpoint as a Hugging Face folder for vLLM, SGLang and transformers.

    Args:
        checkpoint: Lightning `.ckpt` file written while training a DFlashModule.
        out: Folder to write config.json, model.safetensors and modeling_dflash.py to, all or nothing; other files
            already in it are kept, other weight files are refused.
        dtype: Dtype of the saved weights and of config.json's `dtype`; None: the dtype the drafter was trained in (a
            Domino drafter's: bfloat16, the only one SGLang serves it in).
        calibration: calibration.json of `calibrate` for this drafter: its fit for the serving temperature is
            folded into the weights (`Part.fold_calibration`; DSpark: the affine map into `confidence_head.proj`,
            so vLLM's raw sigmoid serves the calibrated confidence).
        calibration_temperature: The temperature the folder is served at, whose fit is folded; None: the file's
            only one.
    """
    cfg, state, target, precision = _read_checkpoint(checkpoint)
    if calibration is not None:  # checked and folded before anything is written
        table = read_calibration(calibration)
        calibration_temperature = pick_temperature(table, calibration_temperature, calibration)
        state = fold(cfg.preset.parts, state, fits_for(table, calibration_temperature, calibration), calibration)
    elif calibration_temperature is not None:
        raise ConfigError("--calibration_temperature without --calibration: give the calibration.json to fold")
    folder, saved = _write_checked(cfg, state, out, served_dtype(cfg, dtype, precision))
    print(f"exported {checkpoint} -> {folder} ({saved} weights, block size {cfg.block_size})")
    if calibration is not None:
        print(f"folded {calibration}'s fit for temperature {calibration_temperature:g} into the weights: serve the "
              f"folder at that temperature (the engines' own calibration files are for the unfolded weights)")
    print_serve_commands(folder, cfg, target, saved)
    return folder


def print_serve_commands(folder: Path, cfg: DrafterConfig, target: str | None, dtype: str) -> None:
    """Print the vLLM and SGLang commands that serve `folder`, and what to watch for."""
    commands = serve_commands(folder, cfg, target)
    drafts = cfg.layout.drafts(cfg.block_size)
    architecture = cfg.preset.architecture
    if "vllm" in commands:
        print(f"serve with vLLM (num_speculative_tokens = {drafts} drafts of a block of {cfg.block_size}):\n"
              f"  {commands['vllm']}")
    else:
        print(f"vLLM: no runtime serves this drafter (a {architecture} with its parts), so no vLLM command")
    if "sglang" in commands:
        print(f"serve with SGLang (reads block_size {cfg.block_size} and dtype {dtype} from config.json):\n"
              f"  {commands['sglang']}")
    else:
        print(f"SGLang: no runtime serves this drafter (a {architecture} with its parts), so no SGLang command")
    for part in cfg.preset.parts:
        for note in part.serve_notes(getattr(cfg, part.name)):
            print(note)
    if target is None:
        print("TARGET_MODEL: the target model the drafter was trained for")
    if dtype == "float32" and "sglang" in commands:
        print("float32 weights: SGLang's --dtype auto serves a float32 config in float16; against a bfloat16 target "
              "export with --dtype bfloat16")


__all__ = [
    "ExportError", "build_drafter", "cast_weights", "check_state_dict", "export_checkpoint", "hf_config",
    "import_folder", "load_drafter", "print_serve_commands", "read_checkpoint", "read_drafter", "replace_folder",
    "serve_commands", "served_dtype", "weights_dtype", "write_config", "write_folder",
]
