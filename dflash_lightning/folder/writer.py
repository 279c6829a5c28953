"""Write a drafter folder: config.json, model.safetensors and the modelling file, all or nothing (`replace_folder`),
the folder's other files carried over; `export_checkpoint` writes a Lightning checkpoint's.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from dflash_lightning.config import DrafterConfig
from dflash_lightning.folder.codec import (
    CONFIG_FILE,
    CONFIG_FILES,
    MODELING_FILE,
    WEIGHTS_FILE,
    DType,
    check_state_dict,
    folder_tensors,
    hf_config,
    served_dtype,
)
from dflash_lightning.folder.reader import read_trained
from dflash_lightning.long_runs.atomic import write_dir_atomic
from dflash_lightning.long_runs.checkpointing import CheckpointError

log = logging.getLogger(__name__)

# What an existing folder may hold that engines or transformers load as weights (with `*.index.json`).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TMP_SUFFIX = ".tmp"  # `.{name}.{pid}.tmp` beside the folder while it is written


class ExportError(CheckpointError):
    """A drafter folder that cannot be written; the message is one line that starts with the folder."""


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, dtype: DType | None = None) -> Path:
    """Write config.json, model.safetensors and the modelling file of a Lightning checkpoint to `out_dir`.

    `dtype` None: the dtype the drafter was trained in (bf16-true and bf16-mixed: bfloat16), else as stored.
    """
    cfg, state, _, precision = read_trained(ckpt_path)  # config and weights checked there, once
    return write_checked(cfg, state, out_dir, served_dtype(cfg, dtype, precision))[0]


def write_folder(cfg: DrafterConfig, state: dict[str, Tensor], out_dir: str | Path, dtype: DType | None = None) -> Path:
    """The Hugging Face folder of a drafter config and its weights (names as in `DFlashDrafter.state_dict`).

    `dtype` casts the saved weights, and config.json's `dtype` names what was saved; None keeps them as they are.
    """
    cfg.check()
    check_state_dict(cfg, state, "export")
    return write_checked(cfg, state, out_dir, dtype)[0]


def write_checked(cfg: DrafterConfig, state: dict[str, Tensor], out_dir: str | Path, dtype: DType | None
                  ) -> tuple[Path, DType]:
    """`write_folder` of a config and weights already checked; returns the folder and the dtype saved.

    The cast is refused (by weight name) before anything is written.
    """
    from safetensors.torch import save_file

    tensors, saved = folder_tensors(state, dtype, "export")

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
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
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


__all__ = [
    "TMP_SUFFIX", "WEIGHT_SUFFIXES", "ExportError", "export_checkpoint", "replace_folder", "write_checked",
    "write_config", "write_folder",
]
