"""`python -m dflash_lightning export`: a Lightning checkpoint -> the Hugging Face folder that vLLM and SGLang load.

The arguments are `export`'s parameters; their help is its docstring. The folder format is `folder/` (`codec.py`
its config.json and weights, `writer.py` the atomic write, `serve.py` the commands printed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jsonargparse import auto_cli

from dflash_lightning.config import ConfigError
from dflash_lightning.decoding.calibration import fits_for, fold, pick_temperature, read_calibration
from dflash_lightning.folder.codec import DType, served_dtype
from dflash_lightning.folder.reader import read_trained
from dflash_lightning.folder.serve import print_serve_commands
from dflash_lightning.folder.writer import write_checked


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
    cfg, state, target, precision = read_trained(checkpoint)
    if calibration is not None:  # checked and folded before anything is written
        table = read_calibration(calibration)
        calibration_temperature = pick_temperature(table, calibration_temperature, calibration)
        state = fold(cfg.preset.parts, state, fits_for(table, calibration_temperature, calibration), calibration)
    elif calibration_temperature is not None:
        raise ConfigError("--calibration_temperature without --calibration: give the calibration.json to fold")
    folder, saved = write_checked(cfg, state, out, served_dtype(cfg, dtype, precision))
    print(f"exported {checkpoint} -> {folder} ({saved} weights, block size {cfg.block_size})")
    if calibration is not None:
        print(f"folded {calibration}'s fit for temperature {calibration_temperature:g} into the weights: serve the "
              f"folder at that temperature (the engines' own calibration files are for the unfolded weights)")
    print_serve_commands(folder, cfg, target, saved)
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m dflash_lightning export --checkpoint X.ckpt --out folder`."""
    auto_cli(export, args=None if argv is None else list(argv))
