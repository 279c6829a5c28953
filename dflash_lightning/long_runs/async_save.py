"""Periodic checkpoints written in the background: the training thread only copies the state to host memory; one
worker writes it atomically (AtomicCheckpointIO) and then does the rotation's deletions and the `last` link.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from dflash_lightning.long_runs.checkpointing import (
    AtomicCheckpointIO,
    CheckpointError,
    checkpoint_bytes,
    nonfinite_weights,
    refuse_nonfinite,
    tensor_checksums,
)

log = logging.getLogger(__name__)


class HostCopy:
    """Copies a checkpoint's tensors into host memory (pinned for GPU tensors), one buffer per storage, reused
    from save to save; storages shared by several tensors stay shared, as `torch.save` writes them."""

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self._pool: dict[tuple[int, bool], list[Tensor]] = {}  # (bytes, pinned) -> uint8 buffers, kept for the run

    def _buffer(self, nbytes: int, pin: bool, free: dict[tuple[int, bool], list[Tensor]]) -> Tensor:
        """A buffer of `nbytes` not used yet by this copy: one of the pool's, or a new one added to it."""
        if free.get((nbytes, pin)):
            return free[(nbytes, pin)].pop()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._pool.setdefault((nbytes, pin), []).append(buf)
        return buf

    def reserve(self, tensors: list[Tensor]) -> int:
        """Allocate, ahead of the first save, a buffer for each storage of `tensors` the pool lacks (the weights and
        optimizer moments: almost all of a checkpoint), so that no save pays for host memory; returns its bytes."""
        needed: dict[tuple[int, bool], int] = {}
        seen: set[tuple[torch.device, int]] = set()
        for t in tensors:
            storage = t.untyped_storage()
            if (t.device, storage.data_ptr()) not in seen:
                seen.add((t.device, storage.data_ptr()))
                key = (storage.nbytes(), self.pin_memory and t.is_cuda)
                needed[key] = needed.get(key, 0) + 1
        added = 0
        for (nbytes, pin), count in needed.items():
            pool = self._pool.setdefault((nbytes, pin), [])
            for _ in range(count - len(pool)):
                pool.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))
                added += nbytes
        return added

    @property
    def buffers(self) -> list[Tensor]:
        """The host buffers held for the copies, in a fixed order."""
        return [b for pool in self._pool.values() for b in pool]

    def __call__(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint with every tensor replaced by a host copy, complete when this returns (so the next
        optimizer step may change the originals). The buffers of the previous call are reused: its write must
        be done."""
        copies: dict[tuple[torch.device, int], Tensor] = {}
        devices: set[torch.device] = set()
        free = {key: list(pool) for key, pool in self._pool.items()}

        def copy(t: Tensor) -> Tensor:
            if type(t) not in (Tensor, torch.nn.Parameter):  # a tensor subclass: no plain storage to copy
                return t.detach().to("cpu", copy=True)
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            host = copies.get(key)
            if host is None:
                pin = self.pin_memory and t.is_cuda
                host = self._buffer(storage.nbytes(), pin, free)
                source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                host.copy_(source, non_blocking=pin)
                copies[key] = host
                if t.is_cuda:
                    devices.add(t.device)
            return torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.size(), t.stride())

        out = apply_to_collection(checkpoint, Tensor, copy)
        for device in devices:  # the copies were queued on each device's current stream
            torch.cuda.current_stream(device).synchronize()
        return out

    @property
    def nbytes(self) -> int:
        """Host memory held for the copies."""
        return sum(b.numel() for b in self.buffers)


def _raise(err: BaseException) -> None:
    raise err


def on_gpu(state_dict: dict[str, Any]) -> bool:
    """Whether a state dict's tensors are on a GPU (where a background save checks and checksums them itself)."""
    return any(isinstance(t, Tensor) and t.is_cuda for t in state_dict.values())


@dataclass
class SaveTiming:
    """One background save: what it cost the training thread and how long the write took."""

    path: str
    wait_s: float  # the training thread waiting for the save before this one
    copy_s: float  # the training thread checking (finite, checksums) and copying the state to host memory
    write_s: float | None = None  # the worker writing it (None while in flight or after a failure)

    @property
    def stall_s(self) -> float:
        return self.wait_s + self.copy_s


class AsyncAtomicCheckpointIO(AsyncCheckpointIO):
    """Lightning's `AsyncCheckpointIO` over `AtomicCheckpointIO`, keeping every guarantee of a synchronous save.

    - The training thread copies the state to host memory (pinned; Lightning's own class clones it on the GPU,
      a second copy of the state in GPU memory) and goes on; the worker writes the copy beside its path, fsyncs
      and renames it. A save waits for the one before it, never drops it.
    - Deletions (the keep-K rotation) and `last.ckpt` links run on the same worker, after the write queued before
      them is complete, and not at all after a failed write.
    - A failed write raises its one-line error on the training thread at the next save, at the next step
      (RunCheckpoint) or at the end of the run, once.
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None, pin_memory: bool = True) -> None:
        """
        Args:
            checkpoint_io: The writer run in the background (default: AtomicCheckpointIO).
            pin_memory: Copy GPU tensors into page-locked host memory (the fastest copy; kept for the run, about
                1.3x the checkpoint's size since the allocator rounds each buffer up to a power of two).
        """
        super().__init__(checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO())
        self.host_copy = HostCopy(pin_memory)
        self.timings: list[SaveTiming] = []
        # the worker and its state are this class's own (the base class's are private to Lightning)
        self._worker: ThreadPoolExecutor | None = None
        self._last: Future | None = None  # the last task queued
        self._failure: BaseException | None = None  # the first failed task; nothing runs after it
        self._raised = False  # the failure was raised on the training thread already

    # ------------------------------------------------------------------------------------ the queue

    def _queue(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._worker is None:  # made here, not in __init__: teardown ends it after each fit
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")

        def task() -> None:
            if self._failure is not None:  # nothing after a failed write: no deletion, no link to it
                return
            try:
                fn(*args)
            except BaseException as err:
                self._failure = err

        self._last = self._worker.submit(task)

    def after_writes(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the worker once the writes queued so far are complete (skipped if one failed)."""
        self._queue(fn, *args)

    def wait(self) -> None:
        """Block until every queued write, deletion and link is done; raise the error of a failed one."""
        if self._last is not None:
            self._last.result()  # the task keeps its error in self._failure
        self.raise_error()

    @property
    def failed(self) -> bool:
        """Whether a background task failed and its error was not raised yet (never waits)."""
        return self._failure is not None and not self._raised

    def raise_error(self) -> None:
        """Raise a background failure on this thread (once); a no-op while none happened."""
        if self._failure is not None and not self._raised:
            self._raised = True
            raise self._failure

    # ------------------------------------------------------------------------------------ CheckpointIO

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        start = time.perf_counter()
        self.wait()  # the save before: its buffers are reused, and its failure stops the run here
        if self._failure is not None:  # raised before (at a step): no save is queued after a failed one
            raise self._failure
        waited = time.perf_counter()
        writer = self.checkpoint_io
        checksums = None
        weights = checkpoint.get("state_dict", {})
        if on_gpu(weights) and isinstance(writer, AtomicCheckpointIO) and storage_options is None:
            # on the GPU (milliseconds), not on the writer's CPU threads, whose intra-op threads compete with the
            # training thread for seconds at the recipe's 12.6 GB (CPU tensors: the writer takes them, as before)
            try:
                refuse_nonfinite(Path(path), nonfinite_weights(weights))
            except CheckpointError as err:
                # a failure of this save like a failed write (nothing is written): under DDP only rank 0 saves,
                # and a background failure stops every rank at the step's end (Preemption), a raise here only rank 0
                self._queue(_raise, err)
                return
            checksums = tensor_checksums(checkpoint)
        snapshot = self.host_copy(checkpoint)
        timing = SaveTiming(str(path), waited - start, time.perf_counter() - waited)
        self.timings.append(timing)
        assert writer is not None

        def write() -> None:
            begin = time.perf_counter()
            if checksums is not None:
                writer.write(snapshot, path, checksums)
            else:
                writer.save_checkpoint(snapshot, path, storage_options)
            timing.write_s = time.perf_counter() - begin
            rank_zero_info(f"checkpoint {path}: written in the background in {timing.write_s:.1f} s; training "
                           f"stalled {timing.stall_s:.2f} s (waiting {timing.wait_s:.2f} s for the write before, "
                           f"checking and copying {timing.copy_s:.2f} s to host memory)")

        self._queue(write)

    def remove_checkpoint(self, path: Any) -> None:
        assert self.checkpoint_io is not None
        self._queue(self.checkpoint_io.remove_checkpoint, path)  # after the successor's write, never before

    def teardown(self) -> None:
        """Wait for every queued write (the end of a run, or an error stopping it); raise a failure not raised
        yet, or log it when another error is already stopping the run."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        err, raised = self._failure, self._raised
        self._failure, self._raised, self._last = None, False, None
        if err is None or raised:
            return
        if sys.exc_info()[1] is not None:  # another error is stopping the run: it goes on; this one is named
            log.error(f"a background checkpoint write failed too: {err}")
            return
        raise err


def innermost(io: Any) -> Any:
    """The CheckpointIO that writes the files, under any wrappers (AsyncCheckpointIO)."""
    while isinstance(getattr(io, "checkpoint_io", None), CheckpointIO):
        io = io.checkpoint_io
    return io


def wait_for_writes(trainer: Any) -> None:
    """Complete the background writes of the trainer's CheckpointIO (a no-op for a synchronous one)."""
    io = trainer.strategy.checkpoint_io
    if isinstance(io, AsyncAtomicCheckpointIO):
        io.wait()


def expected_checkpoint_bytes(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[int, int]:
    """(weights, optimizer state) bytes of a checkpoint of `module`, before any is written: the optimizer's
    tensors where it has them (after a resume), else AdamW's two moments per parameter (-1: unknown)."""
    weights = checkpoint_bytes({"state_dict": module.state_dict()})
    state = 0
    for opt in optimizers:
        if opt.state:
            state += checkpoint_bytes({"state": opt.state_dict()["state"]})
        elif isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            params = [p for g in opt.param_groups for p in g["params"]]
            moments = 3 if any(g.get("amsgrad") for g in opt.param_groups) else 2
            state += moments * sum(p.nbytes for p in params)
        else:
            return weights, -1
    return weights, state


__all__ = ["AsyncAtomicCheckpointIO", "HostCopy", "SaveTiming", "expected_checkpoint_bytes", "innermost",
           "wait_for_writes"]
