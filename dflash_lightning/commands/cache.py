"""`python -m dflash_lightning cache`: the target's context features of a fit config's data, computed once.

The fit command's parser (same config file and overrides) plus the cache's own arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash_lightning.commands.fit import DFlashCLI
from dflash_lightning.config import ConfigError
from dflash_lightning.data import DFlashDataModule
from dflash_lightning.data.feature_cache import FeatureCache, FeatureFormat, data_header, target_header
from dflash_lightning.data.feature_cache_writer import write_cache
from dflash_lightning.module import DFlashModule


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m dflash_lightning cache --config fit.yaml --out DIR [--format bf16|fp8] [--verify true]`."""
    class CacheCLI(DFlashCLI):
        """The fit command's parser (same config file and overrides) plus the cache's own arguments."""

        def add_arguments_to_parser(self, parser) -> None:
            super().add_arguments_to_parser(parser)
            parser.add_argument("--out", type=str, required=True, help="Folder of the feature cache.")
            parser.add_argument("--format", type=FeatureFormat, default="bf16",
                                help="bf16, or fp8 (e4m3 with a float32 scale per token: half the bytes).")
            parser.add_argument("--shard_gb", type=float, default=1.0, help="Feature bytes per shard, in GB.")
            parser.add_argument("--forward_tokens", type=int | None, default=None,
                                help="Tokens per target forward (consecutive samples); None: data.token_budget.")
            parser.add_argument("--final_hidden", type=bool | None, default=None,
                                help="Also store the target's final hidden states (distillation's teacher, bf16); "
                                     "None: when training reads them (model.objective distills, or a "
                                     "part of model.drafter.variant needs them).")
            parser.add_argument("--verify", type=bool, default=False,
                                help="Only check an existing cache against the config and every shard's sha256.")

        def instantiate_trainer(self, **kwargs: Any) -> None:  # type: ignore[override]
            return None  # the cache makes its own predict Trainer from the trainer section

    cli = CacheCLI(DFlashModule, DFlashDataModule, args=None if argv is None else list(argv), run=False,
                   save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False)
    config, dm, module = cli.config, cli.datamodule, cli.model
    target = cli.config_init["target"]
    if target.fp8:  # fit refuses FP8 target features from a cache; writing bf16-target ones would ignore the setting
        raise ConfigError("target.fp8: the cache stores the features of the target in target.dtype, and fit does not "
                          "take FP8 target features from a cache; add --target.fp8=false to write it")
    drafter = module.drafter_config
    if config.verify:
        cache = FeatureCache(config.out)
        splits = {"train": (dm.train_paths, dm.samples("train"))}
        if dm.val_paths:
            splits["val"] = (dm.val_paths, dm.samples("val"))
        cache.check(target_header(target.path, drafter.target_layer_ids, drafter.hidden_size) | data_header(dm, splits),
                    module.hparams.accept_target_change)
        cache.verify()
        print(f"feature cache {config.out}: matches the config, every shard's sha256 verified")
        return
    trainer_cfg = config.trainer
    write_cache(
        dm, target.path, drafter.target_layer_ids, drafter.hidden_size, config.out, config.format, target.dtype,
        target.attn_implementation, int(config.shard_gb * 1e9), config.forward_tokens,
        {"accelerator": trainer_cfg.accelerator, "devices": trainer_cfg.devices, "num_nodes": trainer_cfg.num_nodes},
        module.needs_final_hidden if config.final_hidden is None else config.final_hidden, target.compile,
    )

