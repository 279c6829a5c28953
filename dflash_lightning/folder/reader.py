"""Read a drafter: an exported or published folder (`import_folder`), a Lightning checkpoint (`read_checkpoint`),
either (`read_drafter`), and build it with the target's embedding and head for evaluation (`build_drafter`).
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.folder.codec import CONFIG_FILE, DType, cast_weights, check_state_dict, from_folder
from dflash_lightning.long_runs.checkpointing import CheckpointError, load_checkpoint, nonfinite_weights
from dflash_lightning.long_runs.distributed_checkpoint import is_distributed_checkpoint
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.target_model import DTYPES, load_target_config, load_target_io, weight_map


def import_folder(folder: str | Path, num_target_layers: int | None = None) -> tuple[DrafterConfig, dict[str, Tensor]]:
    """DrafterConfig and weights of a drafter folder (exported here, published, or another trainer's own format that a
    part converts: `Part.convert_folder`), checked key by key. `num_target_layers`: the target's layer count, for
    a folder that does not record it."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_file = folder / CONFIG_FILE
    if not config_file.exists():
        raise FileNotFoundError(f"{folder}: no config.json")
    raw = json.loads(config_file.read_text())
    state: dict[str, Tensor] = {}
    for name in sorted(set(weight_map(folder).values())):
        state.update(load_file(folder / name))
    return from_folder(raw, state, str(folder), num_target_layers)


def read_checkpoint(path: str | Path) -> tuple[DrafterConfig, dict[str, Tensor], str | None]:
    """Drafter config, drafter weights (no `drafter.` prefix) and target path of a Lightning checkpoint."""
    cfg, state, target, _ = read_trained(path)
    return cfg, state, target


def read_trained(path: str | Path) -> tuple[DrafterConfig, dict[str, Tensor], str | None, str | None]:
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


__all__ = ["build_drafter", "import_folder", "load_drafter", "read_checkpoint", "read_drafter", "read_trained"]
