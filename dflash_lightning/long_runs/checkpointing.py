"""Checkpoint files that survive kills and full disks: an atomic `CheckpointIO`, one-line errors for damaged files,
and the choice of the newest complete checkpoint of a run's folder for the automatic resume.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import pickle
import shutil
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from dflash_lightning.long_runs import lightning_compat as compat
from dflash_lightning.long_runs.atomic import link_atomic, write_atomic
from dflash_lightning.long_runs.resume import mid_accumulation

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"  # `.{name}.{pid}.partial` beside the final path while a checkpoint is written
DAMAGED_SUFFIX = ".damaged"  # a damaged checkpoint is renamed so, kept for inspection and never picked again
REQUIRED_KEYS = ("state_dict", "drafter_config", "global_step")
CHECKSUMS_KEY = "dflash_checksums"  # the checkpoint entry: tensor path -> `tensor_checksum` of its bytes


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message is one line that starts with its path."""


def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _named_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """(path, tensor) of every tensor of a checkpoint, the path its keys joined by `/`."""
    if isinstance(obj, Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if key != CHECKSUMS_KEY:
                yield from _named_tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _named_tensors(value, f"{prefix}/{i}" if prefix else str(i))


def tensor_checksum(t: Tensor) -> Tensor:
    """The sum, wrapping at 2**64, of a tensor's bytes read as int64 words (the tail zero-padded): a 0-dim int64 on
    the tensor's device, the same on every device (integer sums do not depend on their order). Any flipped bit and
    any zeroed or overwritten range change it; 8-byte words swapped within the tensor do not. 4-14 GB/s on one CPU
    core (0.07-0.25 s per GB), memory-bound on a GPU."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    tail = data.numel() % 8
    if tail or data.storage_offset() % 8:
        data = torch.cat([data, data.new_zeros(8 - tail if tail else 0)])  # a copy, aligned
    return data.view(torch.int64).sum()


def tensor_checksums(checkpoint: dict[str, Any]) -> dict[str, int]:
    """`tensor_checksum` of every tensor of a checkpoint, by path (one device-to-host copy per device)."""
    return checksums_of(list(_named_tensors(checkpoint)))


def checksums_of(named: list[tuple[str, Tensor]]) -> dict[str, int]:
    """`tensor_checksum` of each (path, tensor), by path (one device-to-host copy per device)."""
    sums = [tensor_checksum(t) for _, t in named]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(sums):
        by_device.setdefault(t.device, []).append(i)
    values: list[int] = [0] * len(sums)
    for indices in by_device.values():
        for i, v in zip(indices, torch.stack([sums[i] for i in indices]).tolist(), strict=True):
            values[i] = v
    return {name: v for (name, _), v in zip(named, values, strict=True)}


_VERIFIED: set[tuple[str, int, int]] = set()  # (path, size, mtime) of the files whose checksums this process checked


def verify_checksums(path: Path, checkpoint: dict[str, Any], files: dict[str, Path] | None = None) -> None:
    """Raise a `CheckpointError` naming the first tensor whose bytes differ from the checksum stored at the save
    (and the file that holds it: `files`, by tensor path, for a folder); a checkpoint without checksums (an older
    version, or another CheckpointIO) passes unchecked."""
    stored = checkpoint.get(CHECKSUMS_KEY)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if not isinstance(stored, dict) or key in _VERIFIED:
        return
    found = tensor_checksums(checkpoint)
    for name, value in found.items():  # tensors removed or added since (an edit: optimizer states dropped) pass
        if name in stored and stored[name] != value:
            where = (files or {}).get(name, path)
            raise CheckpointError(f"{where}: damaged: tensor '{name}' fails its checksum, its bytes changed after the "
                                  f"save (disk or copy damage: use another checkpoint; after an edit on purpose, "
                                  f"drop the file's '{CHECKSUMS_KEY}' entry)")
    _VERIFIED.add(key)


def checkpoint_bytes(checkpoint: dict[str, Any]) -> int:
    """Bytes of tensor data a checkpoint writes (each storage once): what a save needs on disk, give or take 1%."""
    seen: dict[int, int] = {}
    for t in _tensors(checkpoint):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def nonfinite_weights(state_dict: dict[str, Tensor]) -> dict[str, int]:
    """Name -> count of NaN/Inf values, for each floating weight that has any (one host sync for all)."""
    floats = {k: v for k, v in state_dict.items() if isinstance(v, Tensor) and v.is_floating_point() and v.numel()}
    if not floats:
        return {}
    counts: dict[str, int] = {}
    for device in {v.device for v in floats.values()}:  # one copy to the host per device
        names = [k for k, v in floats.items() if v.device == device]
        found = torch.stack([(~torch.isfinite(floats[k].detach())).sum() for k in names]).tolist()
        counts |= dict(zip(names, found, strict=True))
    return {k: int(counts[k]) for k in floats if counts[k]}


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def describe_damage(path: Path, err: BaseException) -> str:
    """What is wrong with a file that torch.load refused, in words (the raw error only as a short detail)."""
    size = path.stat().st_size if path.exists() else 0
    text = " ".join(str(err).split())
    if size == 0:
        return "empty file (0 bytes)"
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        return f"not a PyTorch checkpoint (no zip archive: it starts with {magic!r}; {_size(size)})"
    if "central directory" in text or isinstance(err, (zipfile.BadZipFile, EOFError)):
        return f"truncated ({_size(size)}: the zip index at the end of the file is missing)"
    if isinstance(err, pickle.UnpicklingError) and "weights_only" in text:
        return "holds objects a checkpoint of this project never has (refused by torch.load(weights_only=True))"
    return f"unreadable ({type(err).__name__}: {text[:160]})"


def load_checkpoint(
    path: str | Path, map_location: Any = "cpu", weights_only: bool | None = None, mmap: bool = False,
    required: tuple[str, ...] = REQUIRED_KEYS, verify: bool = True,
) -> dict[str, Any]:
    """A DFlashModule checkpoint (a `.ckpt` file or a distributed checkpoint folder), or a `CheckpointError` naming
    the file and what is wrong in one line; `verify`: its tensors' checksums too (reads every byte, once per file
    and process). With `mmap` a file's tensors are mapped, not read; a folder's, unless verified, are meta-device
    placeholders (only its header is read); a folder's tensors load on the CPU."""
    path = Path(path)
    files = None
    if path.is_dir():  # a distributed checkpoint (a DDP run's preemption save); this module is its base
        ckpt = read_distributed(path, weights_only, tensors=verify or not mmap)
        files = shard_files(path) if verify else None
    elif not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    else:
        try:
            ckpt = torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
        except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for damaged files
            raise CheckpointError(f"{path}: {describe_damage(path, err)}") from err
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (holds a {type(ckpt).__name__}, not a dict)")
    missing = [k for k in required if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a DFlashModule checkpoint (no {', '.join(map(repr, missing))})")
    if verify:
        verify_checksums(path, ckpt, files)
    return ckpt


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint beside its final path, fsyncs and renames it into place; refuses non-finite weights.

    A kill or a full disk during a save leaves the file at the final path as it was (the previous checkpoint), and
    the error names the path, the bytes needed and the bytes free. Nothing goes through TMPDIR.
    """

    last_write: tuple[int, float] | None = None  # (file bytes, seconds) of the newest complete write


    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        self.write(checkpoint, path)

    def write(self, checkpoint: dict[str, Any], path: str | os.PathLike,
              checksums: dict[str, int] | None = None) -> None:
        """`save_checkpoint`; `checksums` given: the finite check and the tensors' checksums were taken already (by a
        background save, on the GPU the tensors were copied from, so that this thread's CPU spends no time on them)."""
        path = Path(path)
        if checksums is None:
            refuse_nonfinite(path, nonfinite_weights(checkpoint.get("state_dict", {})))
            checksums = tensor_checksums(checkpoint)
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint = {**checkpoint, CHECKSUMS_KEY: checksums}
        written = [0]  # bytes of the partial file when the write stopped, for the error

        def save(tmp: Path) -> None:
            try:
                with tmp.open("wb") as f:  # a Python file: a full disk surfaces as the OSError it is
                    torch.save(checkpoint, f)
            finally:
                written[0] = tmp.stat().st_size if tmp.exists() else 0

        start = time.perf_counter()
        try:
            write_atomic(path, save, suffix=PARTIAL_SUFFIX)
            self.last_write = (path.stat().st_size, time.perf_counter() - start)
        except BaseException as err:
            failure = not_written(path, err, checkpoint_bytes(checkpoint), written[0])
            if failure is not None:
                raise failure from err
            raise

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        # Damage is refused in one line; no key is required: the spawn launchers pass a bare state dict this way.
        return load_checkpoint(path, map_location, weights_only, required=())


def refuse_nonfinite(path: Path, bad: dict[str, int]) -> None:
    """Refuse to save a checkpoint whose weights hold NaN or Inf (`bad`: `nonfinite_weights`), naming the tensors."""
    if bad:
        names = ", ".join(f"{k} ({n})" for k, n in list(bad.items())[:4]) + (", ..." if len(bad) > 4 else "")
        raise CheckpointError(
            f"{path}: refusing to save non-finite weights (NaN/Inf values in {len(bad)} tensors: {names}); "
            "the checkpoints already written are kept"
        )


def not_written(path: Path, err: BaseException, needed: int, written: int) -> CheckpointError | None:
    """The one-line error of a save that an OSError stopped (a full disk: the bytes needed, written and free);
    None for other errors."""
    os_err = _os_error(err)
    if os_err is None:
        return None
    free = shutil.disk_usage(path.parent).free
    reason = "disk full" if os_err.errno in (errno.ENOSPC, errno.EDQUOT) else os_err.strerror or str(os_err)
    return CheckpointError(f"{path}: checkpoint not written ({reason}): it needs about {_size(needed)}, "
                           f"{_size(written)} were written, {_size(free)} are free; "
                           "the previous checkpoints are intact")


def _os_error(err: BaseException | None) -> OSError | None:
    """The OSError behind an error: torch.save reports a full disk as a RuntimeError raised while handling it."""
    while err is not None and not isinstance(err, OSError):
        err = err.__cause__ or err.__context__
    return err


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The `.ckpt` files and checkpoint folders of a folder, each once (a `last.ckpt` link counts as its target)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    seen: dict[Path, Path] = {}
    for path in sorted(folder.glob("*.ckpt")):
        if path.name.startswith(".") or (path.is_symlink() and not path.exists()):
            continue
        seen.setdefault(path.resolve(), path)
    return list(seen.values())


def check_writable(folder: str | Path) -> None:
    """Refuse a checkpoint folder that cannot be written, before the first step rather than at the first save."""
    folder = Path(folder).absolute()
    existing = folder  # the folder is made at the first save; until then its nearest existing parent is probed
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file")
        probe = existing / f".write-probe.{os.getpid()}{PARTIAL_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"{folder}: the checkpoint folder is not writable ({err.strerror or err}); "
                              "give a writable ModelCheckpoint dirpath") from err


def remove_partials(folder: str | Path) -> None:
    """Unfinished writes of a killed run: never readable as checkpoints, so they only take space."""
    folder = Path(folder)
    for partial in folder.glob(f".*{PARTIAL_SUFFIX}"):
        if partial.is_dir() and not partial.is_symlink():  # a distributed save's folder
            size = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
            log.warning(f"removing {partial}/: a distributed checkpoint write that did not finish ({_size(size)})")
            shutil.rmtree(partial, ignore_errors=True)
            continue
        log.warning(f"removing {partial}: a checkpoint write that did not finish ({_size(partial.stat().st_size)})")
        partial.unlink(missing_ok=True)


def newest_complete_checkpoint(folder: str | Path) -> Path | None:
    """The readable DFlashModule checkpoint of `folder` with the highest step (None if none); damaged newer files
    are renamed `*.damaged` on rank 0 and named in a warning, so the run says what it fell back from."""
    folder = Path(folder)
    if rank_zero_only.rank == 0 and folder.is_dir():
        remove_partials(folder)
    found: list[tuple[int, float, Path]] = []
    damaged: list[tuple[Path, str]] = []
    for path in checkpoint_files(folder):
        try:  # mmap: only the pickled header is read, not the tensors
            ckpt = load_checkpoint(path, mmap=True, verify=False)
        except CheckpointError as err:
            damaged.append((path, str(err)))
            continue
        reason = mid_accumulation(ckpt)
        if reason is not None:  # kept: a resume of an earlier step overwrites it at its step, at a boundary
            log.warning(f"skipping {path}: {reason}")
            continue
        found.append((int(ckpt["global_step"]), path.stat().st_mtime, path))
    found.sort(key=lambda f: (f[0], f[1]), reverse=True)
    best = None
    for candidate in found:  # the tensors' checksums of the newest, and of older ones only while it fails
        try:
            load_checkpoint(candidate[2], mmap=True)
        except CheckpointError as err:
            damaged.append((candidate[2], str(err)))
            continue
        best = candidate
        break
    for path, reason in damaged:
        fallback = f"resuming from {best[2]} (step {best[0]}) instead" if best else "no complete checkpoint is left"
        log.warning(f"skipping damaged checkpoint {reason}; {fallback}")
        if rank_zero_only.rank == 0:
            set_aside(path)
    return best[2] if best else None


def set_aside(path: Path) -> None:
    """Rename a damaged checkpoint (file or folder) `*.damaged`, kept for inspection and never picked again; for a link
    (`last.ckpt` with `save_last: link`) its target is renamed and the link, which only named it, removed."""
    target = path.resolve() if path.is_symlink() else path
    aside = target.with_name(target.name + DAMAGED_SUFFIX)
    os.replace(target, aside)
    log.warning(f"renamed {target} -> {aside} (kept for inspection)")
    if path.is_symlink():
        path.unlink()
        log.warning(f"removed the link {path} (it pointed to {target})")


class RunCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose `last` is always the newest complete checkpoint, under one name.

    Lightning's `save_last: link` links `last.ckpt` to the newest step file *this process* wrote, or writes a full
    `last-vN.ckpt` after a resume (the link target is not restored and the old `last.ckpt` is taken for another
    run's). Here a `last` save first writes the step file of the current step when none is written yet (so a run
    ending or preempted between periodic saves keeps the step under the keep-K rotation) and then points `last`
    at it; `last` is replaced in place, never versioned. The CLI gives every plain `ModelCheckpoint` this class.
    """

    # overrides the private hook of every `last` save (compat.save_last; checked by tests/test_lightning_compat.py)
    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        if not self.save_last:
            return
        if (self.save_last == "link" and self.save_top_k != 0 and compat.saved_step(self) != trainer.global_step
                and (self.monitor is None or self.monitor in monitor_candidates)):
            compat.save_top_k(self, trainer, monitor_candidates)
        filepath = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        previous, self.last_model_path = self.last_model_path, filepath
        fresh = (compat.saved_step(self) == trainer.global_step and bool(compat.saved_path(self))
                 and compat.saved_path(self) != filepath)
        if self.save_last == "link" and self.save_top_k != 0 and fresh:
            compat.link_checkpoint(self, trainer, compat.saved_path(self), filepath)
        else:  # no step file of this step (not in the top K): the whole state under the last name, atomically
            compat.write_checkpoint(self, trainer, filepath)
        if previous and previous != filepath and compat.should_remove(self, trainer, previous, filepath):
            compat.remove_checkpoint(self, trainer, previous)  # a `last-vN.ckpt` of an older version of this project

    # overrides the private hook of every link (compat.link_checkpoint; checked by tests/test_lightning_compat.py)
    @staticmethod
    def _link_checkpoint(trainer: Trainer, filepath: str, linkpath: str) -> None:
        # Lightning removes `last.ckpt`, then links it: in between there is none. Here it is switched in one
        # rename, and by a background CheckpointIO (`after_writes`) only once the target's write is complete.
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            io = trainer.strategy.checkpoint_io
            run = getattr(io, "after_writes", lambda fn, *args: fn(*args))
            run(link_atomic, Path(linkpath), Path(filepath), PARTIAL_SUFFIX)
        trainer.strategy.barrier()

    # overrides the private check before every save (compat.skips_saving; checked by tests/test_lightning_compat.py)
    def _should_skip_saving_checkpoint(self, trainer: Trainer) -> bool:
        # Inside a gradient accumulation the gradients of the micro-batches trained so far are in no checkpoint: a
        # resume from one would train that optimizer step on part of its rows. Lightning saves there after a resume
        # (every_n_train_steps divides the restored step) and on a train_time_interval; saves wait for the step.
        return super()._should_skip_saving_checkpoint(trainer) or compat.inside_accumulation(trainer)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        # a background write that failed stops the run at the next step, not at the next save hours later
        getattr(trainer.strategy.checkpoint_io, "raise_error", lambda: None)()
        super().on_train_batch_end(trainer, *args)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        # Lightning saves `last` at the end only when nothing was saved in this process; a run whose last step is
        # not a periodic one would leave `last` at an older step.
        if self.save_last and not compat.skips_saving(self, trainer) and trainer.global_step:
            compat.save_last(self, trainer, compat.monitor_candidates(self, trainer))


def move_aside(folder: str | Path) -> Path | None:
    """Moves a folder's checkpoints into `previous-<time>/` (rank 0), so that a fresh run deletes none of them."""
    folder = Path(folder)
    files = [p for p in folder.glob("*.ckpt") if not p.name.startswith(".")] if folder.is_dir() else []
    if not files or rank_zero_only.rank != 0:
        return None
    stamp = time.strftime("previous-%Y%m%d-%H%M%S")
    for n in itertools.count():  # two fresh starts within one second must not collide
        aside = folder / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            aside.mkdir()
            break
        except FileExistsError:
            continue
    for path in files:
        os.replace(path, aside / path.name)  # a relative last.ckpt link keeps pointing at its moved target
    log.warning(f"starting fresh (resume: never): moved {len(files)} checkpoint(s) of {folder} to {aside}")
    return aside


__all__ = [
    "AtomicCheckpointIO", "CheckpointError", "RunCheckpoint", "check_writable", "checkpoint_bytes",
    "checkpoint_files", "load_checkpoint", "move_aside", "newest_complete_checkpoint", "nonfinite_weights",
    "remove_partials", "tensor_checksum", "tensor_checksums", "verify_checksums",
]


# Distributed checkpoint folders (a DDP run's preemption save, long_runs/distributed_checkpoint.py): reading.
META = "meta.pt"  # the non-sharded rest, as in Lightning's own sharded (FSDP) checkpoints
SHARDED = ("state_dict", "optimizer_states")  # replicated on every DDP rank: written once, spread over the ranks
RECORD_KEY = "dflash_distributed"  # in meta.pt: {"ranks": N, "files": {name: bytes}, "write_s": s}; dropped on load
_NO_DIST = "torch.distributed is (disabled, )?unavailable or uninitialized"  # DCP's warning for a 1-process load


def _replace(obj: Any, prefix: str, fn: Callable[[str, Tensor], Any]) -> Any:
    """`obj` with each tensor `t` at checksum path `p` (as `_named_tensors` names it) replaced by `fn(p, t)`."""
    if isinstance(obj, Tensor):
        return fn(prefix, obj)
    if isinstance(obj, dict):
        return {k: _replace(v, f"{prefix}/{k}", fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_replace(v, f"{prefix}/{i}", fn) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # a namedtuple takes fields
    return obj


def split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(the checkpoint with the tensors of SHARDED as meta-device placeholders, those tensors by checksum path)."""
    tensors: dict[str, Tensor] = {}

    def take(name: str, t: Tensor) -> Tensor:
        tensors[name] = t.detach()
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    skeleton = {k: _replace(v, k, take) if k in SHARDED else v for k, v in checkpoint.items()}
    return skeleton, tensors


def _failure(err: BaseException) -> BaseException:
    """The error behind a DCP failure (DCP gathers each rank's into one CheckpointException)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return next(iter(failures.values()))[0]
    return err


def _read_meta(path: Path, weights_only: bool | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a folder's meta.pt without its record, the record), refused in one line if either is missing or damaged."""
    meta = path / META
    if not meta.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint folder (no {META})")
    try:
        header = torch.load(meta, map_location="cpu", weights_only=weights_only)
    except Exception as err:
        raise CheckpointError(f"{meta}: {describe_damage(meta, err)}") from err
    record = header.pop(RECORD_KEY, None) if isinstance(header, dict) else None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: not a distributed checkpoint of this project (no {RECORD_KEY} in {META})")
    return header, record


def distributed_record(path: str | Path) -> dict[str, Any]:
    """How a checkpoint folder was written: ranks, file sizes and (since 2026-12-03) the seconds the write took."""
    return _read_meta(Path(path), weights_only=False)[1]


def read_distributed(path: Path, weights_only: bool | None = None, tensors: bool = True) -> dict[str, Any]:
    """The checkpoint dict of a folder, its tensors on the CPU (`tensors=False`: meta-device placeholders, only
    meta.pt read); a missing, resized or unreadable file is refused in one line naming it."""
    header, record = _read_meta(path, weights_only)
    for name, size in record["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing, a file of the checkpoint written on {record['ranks']} ranks")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file}: damaged: {file.stat().st_size:,} bytes where {size:,} were written "
                                  "(cut short or overwritten: use another checkpoint)")
    if not tensors:
        return header
    skeleton, placeholders = split(header)
    loaded = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in placeholders.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST)
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except BaseException as err:
        if not isinstance(_failure(err), Exception):
            raise
        bad, cause = _unreadable_shard(path, loaded)
        raise CheckpointError(f"{bad}: damaged: unreadable ({type(cause).__name__}: "
                              f"{' '.join(str(cause).split())[:160]})") from cause
    return {k: _replace(v, k, lambda name, _: loaded[name]) if k in SHARDED else v for k, v in skeleton.items()}


def shard_files(path: Path) -> dict[str, Path]:
    """Checksum path -> the file that holds the tensor (meta.pt for the tensors outside the shards)."""
    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    return {index.fqn: path / info.relative_path for index, info in storage.items()}


def _unreadable_shard(path: Path, tensors: dict[str, Tensor]) -> tuple[Path, BaseException]:
    """The first shard file DCP cannot read, and its error, found by loading one file's tensors at a time."""
    by_file: dict[Path, list[str]] = {}
    for name, file in shard_files(path).items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_DIST)
                dcp.load({n: tensors[n] for n in names if n in tensors},
                         storage_reader=dcp.FileSystemReader(path), no_dist=True)
        except BaseException as err:
            cause = _failure(err)
            if isinstance(cause, Exception):
                return file, cause
            raise
    return path, RuntimeError("no single shard fails alone")
