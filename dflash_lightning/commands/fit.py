"""`python -m dflash_lightning fit|validate`: LightningCLI over DFlashModule, DFlashDataModule and the target.

Values that data, model and target must share are typed once and linked: the target path, the token budget
and the block size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch.cli import LightningCLI

from dflash_lightning.data import DFlashDataModule
from dflash_lightning.image_logging import ImageLogging
from dflash_lightning.module import DFlashModule
from dflash_lightning.target import TargetFeatures
from dflash_lightning.validation import SpeculativeValidation


class DFlashCLI(LightningCLI):
    """LightningCLI with `target`, `spec_eval` and `images` sections (callbacks) and the DFlash links."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Only the Trainer entry points that mean something for a drafter."""
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                "validate": {"model", "dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(TargetFeatures, "target")
        parser.add_lightning_class_args(SpeculativeValidation, "spec_eval")
        parser.add_lightning_class_args(ImageLogging, "images")
        parser.link_arguments("target.path", "model.target")
        parser.link_arguments("target.path", "spec_eval.target")
        parser.link_arguments("target.dtype", "spec_eval.dtype")
        parser.link_arguments("target.path", "data.tokenizer")
        parser.link_arguments("data.token_budget", "model.token_budget")
        parser.link_arguments("model.drafter.block_size", "data.block_size")

    def _parse_ckpt_path(self) -> None:
        """Keep the typed settings: LightningCLI would replace them by the checkpoint's hyper-parameters.

        The module compares the two when it loads the checkpoint and refuses changes to what is trained.
        """

    def before_fit(self) -> None:
        """Refuse what the device cannot run (FP8 off Hopper-class GPUs) before the target is loaded."""
        self.model.check_device(self.trainer.strategy.root_device)

    before_validate = before_fit


def main(argv: Sequence[str] | None = None, run: bool = True) -> DFlashCLI:
    """`fit` or `validate` (the first of `argv`); `run=False` only parses and instantiates."""
    torch.set_float32_matmul_precision("high")
    return DFlashCLI(
        DFlashModule,
        DFlashDataModule,
        args=None if argv is None else list(argv),
        run=run,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_kwargs={"allow_abbrev": False},  # `--model.num_anchor=8` is an error, not num_anchors
    )
