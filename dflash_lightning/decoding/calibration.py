"""The calibration file `calibrate` writes (calibration.json), read back by `evaluate` and `export`.

A part fits a calibration on served blocks (`Part.calibrate`, per serving temperature); `evaluate --calibration`
reports the served confidences under it and `export --calibration` folds it into the weights (`Part.fold_calibration`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.base import Part, calibrates

FORMAT = "dflash_lightning calibration 1"
"""calibration.json's `format`: what this reader understands."""


def read_calibration(path: str | Path) -> dict[str, Any]:
    """calibration.json as written by `calibrate`; a file of another shape is refused naming what it lacks."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such calibration file (`python -m dflash_lightning calibrate` writes one)"
                          ) from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    per_temperature = data.get("per_temperature") if isinstance(data, dict) else None
    if not isinstance(per_temperature, dict) or data.get("format") != FORMAT or not all(
            isinstance(entry, dict) and isinstance(entry.get("parts"), dict) for entry in per_temperature.values()):
        raise ConfigError(f"{path}: not a calibration file of `calibrate` (format {FORMAT!r}, "
                          f"per_temperature.<T>.parts)")
    return data


def fits_for(calibration: dict[str, Any], temperature: float, source: str | Path) -> dict[str, dict[str, Any]]:
    """The parts' fits for a serving temperature (by part name); a temperature the file has no fit for is refused,
    naming those it has."""
    entry = calibration["per_temperature"].get(f"{temperature:g}")
    if entry is None:
        have = ", ".join(calibration["per_temperature"]) or "none"
        raise ConfigError(f"{source}: no calibration for temperature {temperature:g} (it has {have}); calibrate at "
                          f"that temperature, or evaluate and serve at one it has")
    return {name: part["fit"] for name, part in entry["parts"].items()}


def pick_temperature(calibration: dict[str, Any], temperature: float | None, source: str | Path) -> float:
    """The serving temperature whose fit to fold: the one given, or the file's only one."""
    have = list(calibration["per_temperature"])
    if temperature is None:
        if len(have) != 1:
            raise ConfigError(f"{source}: fits for temperatures {', '.join(have)}: say which one the folder is served "
                              f"at (--calibration_temperature)")
        return float(have[0])
    fits_for(calibration, temperature, source)  # refuses one it has not
    return temperature


def fold(parts: Sequence[type[Part]], state: dict[str, Tensor], fits: dict[str, dict[str, Any]],
         source: str | Path) -> dict[str, Tensor]:
    """The weights with each part's fit folded in (`Part.fold_calibration`, which refuses a fit of other weights);
    a fit of a part the drafter lacks, or a drafter with nothing to calibrate, is refused."""
    names = {part.name for part in parts}
    foreign = sorted(set(fits) - names)
    if foreign or not any(calibrates(part) for part in parts):
        raise ConfigError(f"{source}: fits parts {', '.join(sorted(fits)) or 'none'}; this drafter's parts that "
                          f"calibrate: {', '.join(p.name for p in parts if calibrates(p)) or 'none'}")
    for part in parts:
        if part.name in fits:
            state = part.fold_calibration(state, fits[part.name], str(source))
    return state


__all__ = ["FORMAT", "fits_for", "fold", "pick_temperature", "read_calibration"]
