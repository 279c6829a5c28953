"""Pictures in the loggers during `fit`: the per-slot accuracy curve of each validation and the served
acceptance histogram of each `spec_eval` run, to TensorBoard and any Lightning logger that takes images.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger

from dflash_lightning.decoding.validation import SpeculativeValidation
from dflash_lightning.pictures.figures import figure_to_array, histogram_figure, slot_curve_figure


def log_figure(logger: Logger, tag: str, fig: Any, step: int) -> bool:
    """Log one matplotlib figure to a logger that takes images; False for loggers that take none (CSV)."""
    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_figure(tag, fig, global_step=step, close=False)
        return True
    if isinstance(logger, MLFlowLogger):
        logger.experiment.log_figure(logger.run_id, fig, f"{tag}/step_{step:08d}.png")
        return True
    if callable(getattr(logger, "log_image", None)):  # W&B, Neptune, Comet: arrays of pixels
        logger.log_image(key=tag, images=[figure_to_array(fig)], step=step)
        return True
    return False


class ImageLogging(Callback):
    """Draws after each validation and each served-tau measurement; rank 0 only, never inside a training step."""

    def __init__(self, enabled: bool = True) -> None:
        """
        Args:
            enabled: Log `val/slot_accuracy` and `val/acceptance_histogram` images to the loggers that take them.
        """
        self.enabled = enabled
        self.logged_served_step = -1
        self.logged: list[tuple[str, int]] = []  # (tag, step) of every image logged, for tests and notebooks

    def _log(self, trainer: Trainer, tag: str, fig: Any, step: int) -> None:
        if any([log_figure(logger, tag, fig, step) for logger in trainer.loggers]):
            self.logged.append((tag, step))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        cfg = pl_module.drafter_config
        trained = range(cfg.layout.first_slot, cfg.block_size)  # the slots that predict, plotted as 1..n
        curves = {}
        for name in ("acc", "top5", "top10"):
            keys = [f"val/{name}/slot_{k:02d}" for k in trained]
            if all(k in metrics for k in keys):
                curves["top-1" if name == "acc" else name.replace("top", "top-")] = [float(metrics[k]) for k in keys]
        if curves:
            self._log(trainer, "val/slot_accuracy",
                      slot_curve_figure(curves, title=f"validation, step {trainer.global_step}"), trainer.global_step)
        self._log_served(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.enabled and trainer.is_global_zero:
            self._log_served(trainer)

    def _log_served(self, trainer: Trainer) -> None:
        """The acceptance histogram of a `spec_eval` report not logged yet (cheap to check: no tensors)."""
        for callback in trainer.callbacks:
            report = getattr(callback, "report", None) if isinstance(callback, SpeculativeValidation) else None
            if report is None or callback.last_step == self.logged_served_step:
                continue
            self.logged_served_step = callback.last_step
            tau = report.get("tau_pooled")
            title = f"served, step {callback.last_step}" + (f", tau {tau:.2f}" if tau is not None else "")
            self._log(trainer, "val/acceptance_histogram",
                      histogram_figure({"served": report["acceptance_histogram"]}, title=title), callback.last_step)
