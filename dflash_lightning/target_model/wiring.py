"""The values that DFlashModule, DFlashDataModule and TargetFeatures must share, and the check that they agree.

Each object gets its values in its constructor (the CLI links them, commands/fit.py); `check_wiring` refuses, in one
line naming both fields, values given by hand that disagree. The objects call it where they meet in a Trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_lightning.config import ConfigError


def _same_path(a: Any, b: Any) -> bool:
    """Equal as given, or the same existing local folder (a relative and an absolute path of one target)."""
    if a == b or a is None or b is None:
        return a == b
    pa, pb = Path(str(a)), Path(str(b))
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _pairs(module: Any, data: Any, target: Any) -> list[tuple[str, Any, str, Any, bool]]:
    """(field, value, source field, source value, paths) of every shared value the objects given carry."""
    pairs = []
    cfg, final = module.drafter_config, module.needs_final_hidden
    if module.loss_settings.distills or not final:
        objective = f"model.objective ({module.loss_settings.objective}: distills {module.loss_settings.distills})"
    else:  # a part of the variant reads the target's final hidden states
        objective = f"model.drafter.variant ({cfg.variant}: reads the target's final hidden states)"
    if data is not None:
        pairs += [("data.token_budget", data.token_budget, "model.token_budget", module.hparams.token_budget, False),
                  ("data.block_size", data.hparams.block_size, "model.drafter.block_size", cfg.block_size, False)]
        if data.hparams.get("feature_cache") is not None:  # the cache's features must be the drafter's
            pairs += [("data.target", data.target, "model.target", module.hparams.target, True),
                      ("data.target_layer_ids", data.target_layer_ids, "model.drafter.target_layer_ids",
                       list(cfg.target_layer_ids), False),
                      ("data.final_hidden", data.final_hidden, objective, final, False)]
    if target is not None:
        pairs += [("target.path", target.path, "model.target", module.hparams.target, True),
                  ("target.final_hidden", target.final_hidden, objective, final, False)]
        cache = data.hparams.get("feature_cache") if data is not None else None
        if data is not None:
            pairs += [("target.feature_cache", target.feature_cache, "data.feature_cache", cache, True)]
        if target.feature_cache is None and cache is None:  # no target runs with a cache: its layers are unused
            pairs += [("target.layer_ids", target.layer_ids, "model.drafter.target_layer_ids",
                       list(cfg.target_layer_ids), False)]
        if target.token_budget is not None and data is not None:
            pairs += [("target.token_budget", target.token_budget, "data.token_budget", data.token_budget, False)]
    return pairs


def check_wiring(module: Any, data: Any = None, target: Any = None) -> None:
    """Raise ConfigError naming the first shared value on which a DFlashDataModule or TargetFeatures disagrees with
    the DFlashModule (or with each other)."""
    if getattr(module, "replays", False):  # Draft-OPD's replay runs the target in this process, on every step
        cache = data.hparams.get("feature_cache") if data is not None else None
        cache = cache or (target.feature_cache if target is not None else None)
        if cache:
            raise ConfigError(f"model.opd.replay: data.feature_cache {cache} serves stored features and no target runs "
                              "to replay the drafts on; drop the cache, or set --model.opd.replay=false")
        if target is not None and target.placement not in ("colocated", "sharded"):
            raise ConfigError(f"model.opd.replay: target.placement {target.placement!r} runs the target away from the "
                              "trainer; replay needs it on the trainer's devices (colocated or sharded), or set "
                              "--model.opd.replay=false")
    for field, value, source, expected, paths in _pairs(module, data, target):
        if not (_same_path(value, expected) if paths else value == expected):
            raise ConfigError(f"{field} {value!r} differs from {source} {expected!r}: give both the same value "
                              "(the CLI links them)")


__all__ = ["check_wiring"]
