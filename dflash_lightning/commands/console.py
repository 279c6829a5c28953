"""What a run prints: a progress bar whose epochs count to the end set by max_steps, a model summary without the
FLOPs Lightning cannot count for a drafter, and none of Lightning's warnings that tell a user of this project nothing.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar

# Lightning's warnings that say nothing about a run of this project, each matched by its message (regex, from the
# start), nothing else silenced:
HARMLESS = (
    # Lightning 2.6 asks torch's pytree the way torch 2.13 deprecates; nothing to do for a user
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # the training rows are an IterableDataset whose length is exact: each worker serves every num_workers-th row of
    # the pass (data/datamodule.py `_TrainRows`), so the length holds with any number of workers
    r"Your `IterableDataset` has `__len__` defined",
)
TIPS = ("💡 Tip: ",)  # Lightning's advertisements of its cloud services, logged at INFO on every start


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TIPS)


def quiet_lightning() -> None:
    """Silence `HARMLESS`, Lightning's tips and transformers' weight-loading bar (5.x draws one per `from_pretrained`;
    downloads keep huggingface_hub's bars). Every command calls this; a notebook may too."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for message in HARMLESS:
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())


class RunProgressBar(RichProgressBar):
    """RichProgressBar whose `Epoch e/last` names the last epoch a run bounded by max_steps reaches, where
    Lightning's reads `Epoch 6/-2` (max_epochs is -1 then); `Epoch e` alone where the epoch length is unknown."""

    # overrides the private hook of the bar's description (checked by tests/test_lightning_compat.py)
    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        last = trainer.max_epochs - 1 if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
        batches = trainer.num_training_batches
        if trainer.max_steps > 0 and batches and math.isfinite(batches):
            by_steps = math.ceil(trainer.max_steps * trainer.accumulate_grad_batches / batches) - 1
            last = by_steps if last is None else min(last, by_steps)
        description = f"Epoch {current_epoch}" + (f"/{last}" if last is not None else "")
        return f"{description:{len(self.validation_description)}}"  # as wide as "Validation": no flicker


class RunModelSummary(RichModelSummary):
    """Lightning's rich model summary without its FLOPs column and total, which read 0: Lightning counts FLOPs only
    by running the module on an `example_input_array`, and a drafter's step needs the target's features."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int = 0, **kwargs: Any) -> None:
        # total_flops: Lightning 2.6 passes it; 2.5 counts no FLOPs and has no such argument
        if total_flops:
            RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                       total_training_modes, total_flops, **kwargs)
            return
        from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, style="dim" if name == " " else None,
                             justify="left" if name in (" ", "Name", "Type", "Mode") else "right")
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
            ("Total params", get_human_readable_count(total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
        ):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(grid)


__all__ = ["HARMLESS", "RunModelSummary", "RunProgressBar", "quiet_lightning"]
