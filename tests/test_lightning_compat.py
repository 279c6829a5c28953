"""Each private Lightning (and torch) name that dflash_lightning/long_runs/lightning_compat.py uses still exists,
takes the arguments it passes and does what the project relies on; a release that changes one fails here, naming it."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from packaging.version import Version

from dflash_lightning.long_runs import lightning_compat as compat
from dflash_lightning.long_runs.checkpointing import RunCheckpoint

VERSION = f"lightning {lightning.__version__}"


def fail(name: str, what: str) -> None:
    pytest.fail(f"{VERSION}: {name} {what}; update dflash_lightning/long_runs/lightning_compat.py", pytrace=False)


def require(owner: type, name: str, params: list[str]) -> None:
    """`owner.name` exists and its parameters are named `params` (`self` included)."""
    fn = inspect.getattr_static(owner, name, None)
    if fn is None:
        fail(f"{owner.__name__}.{name}", "is gone")
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    found = list(inspect.signature(fn).parameters)
    if found != params:
        fail(f"{owner.__name__}.{name}", f"takes ({', '.join(found)}), not ({', '.join(params)})")


def require_attr(obj: object, name: str, kind: type) -> None:
    if not isinstance(getattr(obj, name, None), kind):
        fail(f"{type(obj).__name__}.{name}", f"is not a {kind.__name__} attribute any more")


def calls(owner: type, method: str, call: str) -> None:
    """`owner.method`'s source still calls `call` (a hook the project relies on being reached)."""
    if call not in inspect.getsource(getattr(owner, method)):
        fail(f"{owner.__name__}.{method}", f"no longer calls {call}")


class Accumulation(Callback):
    """Records `compat.inside_accumulation` and `compat.processed_batches` after each training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append((compat.inside_accumulation(trainer), compat.processed_batches(trainer)))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A BoringModel fit of 5 batches with gradient accumulation 2 and a checkpoint every optimizer step."""
    folder = tmp_path_factory.mktemp("ckpt")
    cb = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_top_k=-1, save_last=True)
    record = Accumulation()
    trainer = Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=5, limit_val_batches=0,
                      accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[cb, record])
    trainer.fit(BoringModel())
    return trainer, cb, record, Path(folder)


def test_attached_trainer():

    module = BoringModel()
    if "_trainer" not in vars(module):
        fail("LightningModule._trainer", "is no longer set in __init__")
    assert compat.attached_trainer(module) is None
    trainer = Trainer(accelerator="cpu", logger=False)
    module.trainer = trainer
    assert compat.attached_trainer(module) is trainer


def test_inside_accumulation_and_processed_batches(fitted):
    _, _, record, _ = fitted
    # batches 1, 3 are inside an accumulation of 2; 5, the epoch's last, steps anyway
    assert record.seen == [(True, 1), (False, 2), (True, 3), (False, 4), (False, 5)], f"{VERSION}: {record.seen}"


def test_saved_batch_progress(fitted):
    _, _, _, folder = fitted
    ckpt = torch.load(folder / "last.ckpt", weights_only=False)
    try:
        progress = compat.saved_batch_progress(ckpt)
    except KeyError as err:
        fail("checkpoint['loops']", f"has no fit_loop / epoch_loop.batch_progress entry ({err})")
    for scope in ("total", "current"):
        if set(progress.get(scope, {})) != {"ready", "started", "processed", "completed"}:
            fail("epoch_loop.batch_progress", f"'{scope}' counters changed: {progress.get(scope)}")
    assert progress["total"]["processed"] == 5


@pytest.mark.parametrize(("owner", "name", "params"), [
    (_TrainingEpochLoop, "_should_accumulate", ["self"]),
    (ModelCheckpoint, "_monitor_candidates", ["self", "trainer"]),
    (ModelCheckpoint, "_save_topk_checkpoint", ["self", "trainer", "monitor_candidates"]),
    (ModelCheckpoint, "_save_last_checkpoint", ["self", "trainer", "monitor_candidates"]),
    (ModelCheckpoint, "_save_checkpoint", ["self", "trainer", "filepath"]),
    (ModelCheckpoint, "_link_checkpoint", ["trainer", "filepath", "linkpath"]),
    (ModelCheckpoint, "_should_remove_checkpoint", ["self", "trainer", "previous", "current"]),
    (ModelCheckpoint, "_remove_checkpoint", ["self", "trainer", "filepath"]),
    (ModelCheckpoint, "_should_skip_saving_checkpoint", ["self", "trainer"]),
    (RichProgressBar, "_get_train_description", ["self", "current_epoch"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_private_methods(owner, name, params):
    require(owner, name, params)


def test_model_checkpoint_state(fitted):
    trainer, cb, _, folder = fitted
    for name, kind in (("_last_global_step_saved", int), ("_last_checkpoint_saved", str)):
        require_attr(cb, name, kind)
    assert compat.saved_step(cb) == trainer.global_step == 3
    assert Path(compat.saved_path(cb)).is_file()
    candidates = compat.monitor_candidates(cb, trainer)
    assert int(candidates["step"]) == trainer.global_step and "epoch" in candidates
    assert compat.skips_saving(cb, trainer)  # not fitting any more
    assert not compat.should_remove(cb, trainer, str(folder.parent / "elsewhere.ckpt"), str(folder / "x.ckpt"))


def test_run_checkpoint_override_is_reached():
    # RunCheckpoint overrides `_save_last_checkpoint`: every `last` save of Lightning's hooks must go through it
    for hook in ("on_train_batch_end", "on_train_epoch_end", "on_validation_end"):
        calls(ModelCheckpoint, hook, "self._save_last_checkpoint(")
    calls(ModelCheckpoint, "_save_last_checkpoint", "self._save_checkpoint(")
    # ... and `_should_skip_saving_checkpoint` (no save inside a gradient accumulation): every hook that saves asks it
    for hook in ("on_train_batch_end", "on_train_epoch_end", "on_validation_end"):
        calls(ModelCheckpoint, hook, "self._should_skip_saving_checkpoint(")


def test_save_now_writes_a_step_file_and_last(tmp_path):
    """What preemption does on a step between periodic saves: top-k save, then last (through RunCheckpoint)."""

    class SaveAtStep2(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 2:
                candidates = compat.monitor_candidates(cb, trainer)
                compat.save_top_k(cb, trainer, candidates)
                compat.save_last(cb, trainer, candidates)
                self.saved = (compat.saved_step(cb), Path(compat.saved_path(cb)).name)

    cb = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=100, save_top_k=2,
                         monitor="step", mode="max", save_last="link")
    compat.adopt_class(cb, RunCheckpoint)
    probe = SaveAtStep2()
    trainer = Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[cb, probe])
    trainer.fit(BoringModel())
    assert probe.saved == (2, "step=2.ckpt")
    assert (tmp_path / "step=2.ckpt").is_file()
    assert (tmp_path / "last.ckpt").resolve() == (tmp_path / "step=3.ckpt").resolve()  # on_train_end moved it on


def test_adopt_class():
    if "__slots__" in vars(ModelCheckpoint):
        fail("ModelCheckpoint", "has __slots__: its class can no longer be swapped")
    cb = ModelCheckpoint()
    compat.adopt_class(cb, RunCheckpoint)
    assert type(cb) is RunCheckpoint

    class WithState(ModelCheckpoint):
        def __init__(self) -> None:
            super().__init__()

    with pytest.raises(TypeError, match="must add no state"):
        compat.adopt_class(ModelCheckpoint(), WithState)


def test_set_last_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    if not hasattr(scheduler, "_last_lr"):
        fail("torch LRScheduler._last_lr", f"is gone (torch {torch.__version__})")
    compat.set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25], f"torch {torch.__version__}: get_last_lr() no longer reads _last_lr"


def test_typed_settings_cli():
    if Version(lightning.__version__) < Version("2.5.5"):  # before it, --ckpt_path left the settings alone
        if inspect.getattr_static(LightningCLI, "_parse_ckpt_path", None) is not None:
            fail("LightningCLI._parse_ckpt_path", "exists before 2.5.5")
    else:
        require(LightningCLI, "_parse_ckpt_path", ["self"])
        calls(LightningCLI, "__init__", "self._parse_ckpt_path()")
    assert compat.TypedSettingsCLI._parse_ckpt_path(None) is None  # a no-op: the typed settings stay
