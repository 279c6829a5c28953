"""Distributed checkpoints for the preemption save of a DDP run: every rank writes its share of the weights and
optimizer state (torch.distributed.checkpoint de-duplicates the replicated tensors across ranks, balancing the
bytes), and any number of ranks, or one process, reads the folder back as the same dict a `.ckpt` file holds.

A folder `step=N.ckpt/` holds DCP's `.metadata` and `__<rank>_<i>.distcp` shards (the tensors of `state_dict` and
`optimizer_states`, each under its checksum path) and `meta.pt`: the rest of rank 0's checkpoint (loops,
callbacks, hyper-parameters, settings record), those tensors as meta-device placeholders, the checksums of every
tensor and the size of every file. It is written as `.step=N.ckpt.<pid>.partial/` and renamed by rank 0 once every
rank finished, so a folder at a final name is complete; a SIGKILL leaves only the hidden partial folder.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import DDPStrategy

from dflash_lightning.long_runs.atomic import fsync_dir, put_in_place
from dflash_lightning.long_runs.checkpointing import (
    _NO_DIST,
    CHECKSUMS_KEY,
    META,
    PARTIAL_SUFFIX,
    RECORD_KEY,
    CheckpointError,
    _failure,
    _named_tensors,
    checksums_of,
    nonfinite_weights,
    not_written,
    read_distributed,
    refuse_nonfinite,
    shard_files,
    split,
)


@dataclass
class DistributedWrite:
    """One distributed save as this rank saw it."""

    path: str
    ranks: int
    total_bytes: int  # every file of the folder
    rank_bytes: int  # the shards this rank wrote
    seconds: float  # from the call to the folder in place, on this rank


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a checkpoint folder (the format here, or Lightning's sharded one) rather than a file."""
    return (Path(path) / META).is_file()


# ------------------------------------------------------------------------------------------------ the save


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def _from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (an error message, a path)."""
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _by_share(compute: Callable[[list[str]], dict[str, int]], names: list[str]) -> dict[str, int]:
    """`compute` over this rank's share of `names` (every world-th), all ranks' results merged, on every rank:
    a check of the replicated tensors costs each rank 1/world of it."""
    rank, world = _rank_world()
    mine = compute(sorted(names)[rank::world])
    if world == 1:
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def save_distributed(checkpoint: dict[str, Any], path: str | Path, thread_count: int = 1) -> DistributedWrite:
    """Write `checkpoint` as a folder at `path`, every rank of the default process group taking part with its
    (identical) copy; rank 0's non-tensor state is the one kept. Returns once the folder is in place on all ranks.

    A failure on any rank (a full disk: one line with the bytes needed and free) raises on every rank and leaves
    `path` as it was.
    """
    start = time.perf_counter()
    rank, world = _rank_world()
    path = Path(os.path.abspath(path))
    weights = checkpoint.get("state_dict", {})
    # every rank the same answer (all refuse, none waits alone), each having checked its share
    refuse_nonfinite(path, _by_share(lambda names: nonfinite_weights({n: weights[n] for n in names}), list(weights)))
    tmp = Path(_from_rank0(str(path.with_name(f".{path.name}.{os.getpid()}{PARTIAL_SUFFIX}"))))
    skeleton, tensors = split(checkpoint)
    error = ""
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as err:
            error = f"{path}: checkpoint not written ({err.strerror or err})"
    if error := _from_rank0(error):
        raise CheckpointError(error)
    sums = _by_share(lambda names: checksums_of([(n, tensors[n]) for n in names]), list(tensors))
    needed = sum(t.nbytes for t in tensors.values())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST)
            metadata = dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, thread_count=thread_count),
                                no_dist=world == 1)
    except BaseException as err:  # raised on every rank (DCP gathers the failures); a BaseException itself
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = _failure(err)
        if not isinstance(cause, Exception):
            raise
        raise not_written(path, cause, needed, 0) or CheckpointError(
            f"{path}: checkpoint not written ({type(cause).__name__}: {cause})") from cause
    failed: BaseException | None = None
    if rank == 0:
        try:
            rest = [(n, t) for n, t in _named_tensors(skeleton) if not t.is_meta]  # rank 0's own, kept in meta.pt
            skeleton[CHECKSUMS_KEY] = sums | checksums_of(rest)
            files = {p.name: p.stat().st_size for p in tmp.iterdir()}
            record = {"ranks": world, "files": files, "write_s": time.perf_counter() - start}  # the shards: done
            torch.save({**skeleton, RECORD_KEY: record}, tmp / META)
            with (tmp / META).open("rb") as f:
                os.fsync(f.fileno())
            fsync_dir(tmp)  # the shards were fsynced by their writers
            put_in_place(tmp, path)
            fsync_dir(path.parent)
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            failed = not_written(path, err, needed, 0) or err
            error = str(failed) if isinstance(failed, CheckpointError) else f"{path}: checkpoint not written ({err})"
    if error := _from_rank0(error):  # rank 0's last steps, which the other ranks wait for
        raise CheckpointError(error) from failed
    total = sum((path / name).stat().st_size for name in os.listdir(path)) if rank == 0 else 0
    mine = sum(info.length for info in metadata.storage_data.values() if info.relative_path.startswith(f"__{rank}_"))
    return DistributedWrite(str(path), world, _from_rank0(total), mine, time.perf_counter() - start)


class DistributedSaveDDP(DDPStrategy):
    """Lightning's DDPStrategy whose saves inside `distributed_saves()` (the preemption save) write a distributed
    checkpoint folder, every rank its share, instead of one file from rank 0; the CLI gives every plain DDPStrategy
    this class. Lightning 2.6 has no distributed save for DDP (only FSDP's and ModelParallel's sharded states)."""

    _distributed = False
    last_write: DistributedWrite | None = None

    @contextmanager
    def distributed_saves(self) -> Iterator[None]:
        """Inside: `trainer.save_checkpoint` writes a distributed checkpoint (all ranks call it, as Lightning does)."""
        self._distributed = True
        try:
            yield
        finally:
            self._distributed = False

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self._distributed:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}'s distributed saves take no storage_options")
        self.last_write = save_distributed(checkpoint, filepath)
        return None


# ------------------------------------------------------------------------------------------------ the load


__all__ = ["DistributedSaveDDP", "DistributedWrite", "is_distributed_checkpoint", "read_distributed",
           "save_distributed", "shard_files", "split"]
