"""Preemption: SIGTERM, SIGUSR1 or SIGINT during `fit` ends the current step on every rank, writes one checkpoint
of that step through the ModelCheckpoint callback, and exits with 128 + the signal number, which schedulers retry.
The restarted command resumes (`resume: auto`, done by the CLI) from the newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from dflash_lightning.long_runs import lightning_compat as compat
from dflash_lightning.long_runs.async_save import (
    AsyncAtomicCheckpointIO,
    expected_checkpoint_bytes,
    innermost,
    wait_for_writes,
)
from dflash_lightning.long_runs.checkpointing import CheckpointError, _size, distributed_record
from dflash_lightning.long_runs.distributed_checkpoint import DistributedSaveDDP, is_distributed_checkpoint

log = logging.getLogger(__name__)


def retry_code(signum: int) -> int:
    """The exit status of a preempted run: what a shell reports for a process ended by that signal (SIGTERM: 143,
    SIGUSR1: 138, SIGINT: 130), read as "retry" by torchrun, Kubeflow's ExitCode policy and SLURM scripts."""
    return 128 + int(signum)


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is complete; its `code` is `retry_code(signal)`."""


class Preemption(Callback):
    """Turns SIGTERM, SIGUSR1 and SIGINT into a checkpoint at the next step boundary and a retry exit status."""

    def __init__(self, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT"), requeue: bool = True,
                 resume: Literal["auto", "never"] = "auto", grace_s: float = 30.0) -> None:
        """
        Args:
            signals: Signals that stop the run at the next step boundary with a checkpoint of that step. The first
                one received counts; a second SIGINT interrupts at once (the checkpoints already written are kept).
            requeue: Under SLURM, rank 0 runs `scontrol requeue $SLURM_JOB_ID` after the checkpoint of a SIGUSR1
                (the `--signal=USR1@120` warning) is written, so the job starts again and resumes.
            resume: auto: a `fit` without `--ckpt_path` continues from the newest complete checkpoint of the
                ModelCheckpoint folder (a damaged one is skipped with a warning and renamed `*.damaged`); never:
                start at step 0, after moving that folder's checkpoints into `previous-<time>/`.
            grace_s: Seconds the scheduler waits between its signal and a kill (Kubernetes'
                terminationGracePeriodSeconds, 30 by default; SLURM's --signal=USR1@<s>). After the first save,
                a warning says so when a preemption save would take longer at the measured write rate.
        """
        names = {s.name for s in signal.Signals}
        unknown = [s for s in signals if s not in names]
        if unknown:
            raise ValueError(f"preemption.signals: unknown signal name(s) {unknown}")
        self.signals = tuple(signal.Signals[s] for s in signals)
        if resume not in ("auto", "never"):
            raise ValueError(f"preemption.resume must be auto or never, got {resume!r}")
        if not grace_s > 0:
            raise ValueError(f"preemption.grace_s must be > 0 seconds, got {grace_s!r}")
        self.requeue = requeue
        self.resume = resume
        self.grace_s = float(grace_s)
        self._reported_write = self._reserved = False
        self.received: int = 0  # signal number, 0 while none
        self._previous: dict[int, Any] = {}
        self._group: Any = None

    # ------------------------------------------------------------------------------------ handlers

    def _handle(self, signum: int, frame: Any) -> None:
        # Only a flag here: collectives or file writes inside a signal handler would interleave with the step.
        if self.received == 0:
            self.received = signum
            log.warning(f"received {signal.Signals(signum).name}: finishing the current step, then a checkpoint")
        if signum == signal.SIGINT:  # a second Ctrl+C interrupts at once
            signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning's own handlers (registered just before): ours replace them for the run, and Lightning's
        # teardown puts back the handlers from before `fit`.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            # a host-side group: agreeing on the flag each step never waits for the GPU
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self._reported_write = self._reserved = False
        if trainer.is_global_zero:
            self._report_size(trainer, pl_module)
            self._report_resumed_save(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Preempted) and self.received in (signal.SIGTERM, signal.SIGUSR1):
            release_for_exit(trainer, pl_module)  # a scheduler ends the process; Ctrl+C (a notebook) keeps them

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self._reported_write and trainer.is_global_zero:  # a first write completed after the last step
            self._report_write(trainer)
        for sig, handler in self._previous.items():
            if threading.current_thread() is threading.main_thread() and handler is not None:
                signal.signal(sig, handler)
        self._previous.clear()

    def _agreed(self, trainer: Trainer) -> tuple[int, bool]:
        """The signal any rank received (the largest number if several), and whether any rank's background write
        failed, the same on every rank: one host-side all-reduce a step."""
        io = trainer.strategy.checkpoint_io
        failed = isinstance(io, AsyncAtomicCheckpointIO) and io.failed
        if self._group is None:
            return self.received, failed
        flag = torch.tensor([self.received, int(failed)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag[0]), bool(flag[1])

    # ------------------------------------------------------------------------------------ the stop

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._reported_write and trainer.is_global_zero:
            self._report_write(trainer)
        if not self._reserved and trainer.is_global_zero and not compat.inside_accumulation(trainer):
            self._reserve_host_memory(trainer, pl_module)
        if compat.inside_accumulation(trainer):
            return  # inside a gradient accumulation: its gradients are not saved, so stop at the optimizer step
        signum, failed = self._agreed(trainer)
        if failed:  # rank 0's periodic write: every rank stops now, none waits for it in a later collective
            self._wait_for_writes_on_every_rank(trainer)
        if not signum:
            return
        self.received = signum
        name = signal.Signals(signum).name
        path = self.save(trainer)
        wait_for_writes(trainer)  # its own (a background one): complete, or its error raised, before the exit status
        if self.requeue and signum == signal.SIGUSR1 and SLURMEnvironment.detect() and trainer.is_global_zero:
            _slurm_requeue()
        code = retry_code(signum)
        written = getattr(trainer.strategy, "last_write", None)
        how = "" if written is None or os.path.realpath(written.path) != os.path.realpath(path) else (
            f" ({_size(written.total_bytes)} written by {written.ranks} ranks, {_size(written.rank_bytes)} by this "
            f"one, in {written.seconds:.1f} s)")
        log.warning(f"{name}: checkpoint of step {trainer.global_step} at {path}{how}; exiting with {code} (retry)")
        raise Preempted(code)

    def save(self, trainer: Trainer) -> str:
        """One checkpoint of the step just finished, through the ModelCheckpoint callback (its folder, names and
        keep-last-K rotation); returns its path. Under DDP it is a distributed checkpoint, every rank writing its
        share (long_runs/distributed_checkpoint.py)."""
        callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        for cb in callbacks:
            if compat.saved_step(cb) == trainer.global_step:  # it saved this very step already
                return cb.last_model_path or compat.saved_path(cb)
        self._wait_for_writes_on_every_rank(trainer)  # a periodic write in flight first: the disk is this save's
        strategy = trainer.strategy
        with strategy.distributed_saves() if isinstance(strategy, DistributedSaveDDP) else contextlib.nullcontext():
            return self._save(trainer, callbacks)

    def _wait_for_writes_on_every_rank(self, trainer: Trainer) -> None:
        """Complete the periodic write in flight (rank 0's); if it failed, every rank raises its one-line error
        here (before a distributed save, whose collectives would otherwise wait for rank 0 until they time out)."""
        failure: BaseException | None = None
        try:
            wait_for_writes(trainer)
        except Exception as err:
            failure = err
        if self._group is None:
            if failure is not None:
                raise failure
            return
        lines: list[str | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(lines, None if failure is None else str(failure), group=self._group)
        if failure is not None:
            raise failure
        line = next((line for line in lines if line is not None), None)
        if line is not None:
            raise CheckpointError(f"{line} (a background write of rank {lines.index(line)}; this rank stops too)")

    def _save(self, trainer: Trainer, callbacks: list[ModelCheckpoint]) -> str:
        for cb in callbacks:
            # what ModelCheckpoint does on a step it saves at (Lightning has no public "save now")
            candidates = compat.monitor_candidates(cb, trainer)
            if cb.monitor is None or cb.monitor in candidates:
                compat.save_top_k(cb, trainer, candidates)
            compat.save_last(cb, trainer, candidates)
            if compat.saved_step(cb) == trainer.global_step:
                return cb.last_model_path or compat.saved_path(cb)
        folder = callbacks[0].dirpath if callbacks and callbacks[0].dirpath else os.path.join(
            trainer.default_root_dir, "checkpoints")
        path = os.path.join(folder, f"preempted-step={trainer.global_step}.ckpt")
        trainer.save_checkpoint(path)
        return path

    # ------------------------------------------------------------------------------------ what a save costs

    def _report_size(self, trainer: Trainer, pl_module: LightningModule) -> None:
        weights, state = expected_checkpoint_bytes(pl_module, trainer.optimizers)
        io = trainer.strategy.checkpoint_io
        how = "in the background (AsyncAtomicCheckpointIO)" if isinstance(io, AsyncAtomicCheckpointIO) else (
            f"synchronously ({type(io).__name__})")
        optimizer = f"{_size(state)} optimizer state" if state >= 0 else "optimizer state of unknown size"
        rank_zero_info(f"checkpoints: about {_size(weights + max(state, 0))} each ({_size(weights)} weights + "
                       f"{optimizer}), written {how}")

    def _report_resumed_save(self, trainer: Trainer) -> None:
        """Resuming from a distributed preemption save: how long it took on its ranks, and a warning when that
        outlasts `grace_s` (the estimate after the first periodic save assumes one rank writing everything)."""
        path = trainer.ckpt_path
        if not path or not is_distributed_checkpoint(path):
            return
        record = distributed_record(path)
        seconds = record.get("write_s")
        if seconds is None:  # written before the record held its time
            return
        line = f"the checkpoint this run resumes from was written by {record['ranks']} ranks in {seconds:.1f} s"
        if seconds > self.grace_s:
            log.warning(f"preemption.grace_s={self.grace_s:g}: {line}, longer than the scheduler waits after its "
                        "signal: give the job a longer grace period (Kubernetes terminationGracePeriodSeconds, "
                        "SLURM --signal=USR1@<s>) and set grace_s to it")
        else:
            rank_zero_info(f"{line} (within preemption.grace_s={self.grace_s:g})")

    def _reserve_host_memory(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """After the first optimizer step (its moments exist now), the background saves' host buffers for the
        weights and moments, so that no periodic save, hours in, pays for allocating pinned memory."""
        self._reserved = True
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, AsyncAtomicCheckpointIO):
            return
        start = time.perf_counter()
        tensors = [t for t in pl_module.state_dict().values() if isinstance(t, torch.Tensor)]
        for optimizer in trainer.optimizers:
            tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        added = io.host_copy.reserve(tensors)
        if added:
            rank_zero_info(f"checkpoints: {_size(added)} of host memory reserved for background saves "
                           f"in {time.perf_counter() - start:.1f} s")

    def _report_write(self, trainer: Trainer) -> None:
        """After the first complete write: its rate, and a warning when a preemption save outlasts `grace_s`."""
        io = trainer.strategy.checkpoint_io
        written = getattr(innermost(io), "last_write", None)
        if written is None:
            return
        self._reported_write = True
        nbytes, seconds = written
        background = isinstance(io, AsyncAtomicCheckpointIO) and bool(io.timings)
        stall = f"; training stalled {io.timings[0].stall_s:.2f} s" if background else ""
        rank_zero_info(f"checkpoint written: {_size(nbytes)} in {seconds:.1f} s "
                       f"({nbytes / max(seconds, 1e-9) / 1e6:,.0f} MB/s){stall}")
        # a preemption save waits for a periodic one in flight, then writes its own
        worst = 2 * seconds if background else seconds
        if worst > self.grace_s:
            log.warning(f"preemption.grace_s={self.grace_s:g}: a preemption save takes about {seconds:.0f} s here"
                        + (f" (up to {worst:.0f} s with a periodic save in flight)" if background else "")
                        + ", longer than the scheduler waits after its signal: give the job a longer grace period "
                        "(Kubernetes terminationGracePeriodSeconds, SLURM --signal=USR1@<s>) and set grace_s to it")


def release_for_exit(trainer: Trainer, pl_module: LightningModule) -> None:
    """Drop the optimizer state, gradients and module tensors of a run whose checkpoint is complete and which exits
    now: Lightning's teardown would copy them to host memory first (about 8 s of a 30 s grace period at the
    Qwen3-8B recipe's 12.6 GB, benchmarks/RESULTS.md). Sharded (DTensor) parameters are left as they are."""
    for optimizer in trainer.optimizers:
        optimizer.state.clear()
    for tensor in itertools.chain(pl_module.parameters(), pl_module.buffers()):
        tensor.grad = None
        if type(tensor.data) is torch.Tensor:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _slurm_requeue() -> None:
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ["SLURM_JOB_ID"]
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except OSError as err:  # no scontrol in the container: the retry exit status still asks for a rerun
        log.error(f"could not requeue SLURM job {job}: scontrol not runnable ({err.strerror or err})")
        return
    if result.returncode == 0:
        log.warning(f"requeued SLURM job {job}")
    else:
        log.error(f"scontrol requeue {job} failed ({result.returncode}): {result.stderr.strip()}")


__all__ = ["Preempted", "Preemption", "retry_code"]
