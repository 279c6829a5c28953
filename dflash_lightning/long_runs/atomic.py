"""Atomic file and folder writes: a reader sees the old file (folder) or the whole new one, never a torn one.

The temporary file or folder lives beside the final path (same filesystem), so the rename is atomic.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Any, suffix: str = ".tmp") -> None:
    """`write(tmp_path)`, fsync, then rename over `path`: a reader sees the old file or the whole new one.

    The temporary file is `.<name>.<pid><suffix>` beside `path`; a write that fails removes it.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}{suffix}")
    try:
        write(tmp)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        put_in_place(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def link_atomic(link: Path, target: Path, suffix: str = ".tmp") -> None:
    """Point `link` at `target` (a relative symlink) in one rename: a reader sees the old link or file, or the new
    link, never no file (removing first, then linking, leaves none in between). A copy where links are refused."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}{suffix}")
    if tmp.exists() or tmp.is_symlink():  # left by a killed process of the same pid
        _remove(tmp)
    try:
        os.symlink(os.path.relpath(target, link.parent), tmp)
    except OSError:  # Windows without the right to make links
        (shutil.copytree if target.is_dir() else shutil.copy)(target, tmp)
    try:
        put_in_place(tmp, link)  # over a file, a link, or a folder (a distributed `last` checkpoint)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(link.parent)


def write_json(path: Path, obj: Any) -> None:
    """A JSON file written atomically."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))


def fsync_tree(folder: Path) -> None:
    """Make every file and folder under `folder` durable (folders after their entries)."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = Path(root, name)
            if not path.is_symlink():
                with path.open("rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(Path(root))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system or filesystem lacks it."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def put_in_place(tmp: Path, path: Path) -> None:
    """Rename the finished `tmp` (a file or a folder) to `path`, replacing what is there (nothing, a file, a link or a
    folder) in one step; what it replaced is removed after.

    Where the filesystem cannot swap a folder in one step (not Linux, some network filesystems) the old one is moved
    aside to `.<name>.<pid>.old` first, so a kill in that instant leaves it there, complete, and `path` missing.
    """
    if not path.exists() and not path.is_symlink():
        os.rename(tmp, path)
    elif not _is_folder(tmp) and not _is_folder(path):
        os.replace(tmp, path)  # a file or link over a file or link
    elif _exchange(tmp, path):
        _remove(tmp)  # now what `path` was
    else:
        old = path.with_name(f".{path.name}.{os.getpid()}.old")
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
        _remove(old)


def write_dir_atomic(path: Path, write: Callable[[Path], None], suffix: str = ".tmp") -> None:
    """`write(tmp_folder)`, fsync its tree, then put it at `path`: a reader sees the old folder or the whole new one.

    The temporary folder is `.<name>.<pid><suffix>` beside `path` (a symlink `path` is written through); an existing
    folder is replaced by `put_in_place`. A write that fails removes the temporary folder and leaves `path` as it was.
    """
    path = path.resolve() if path.is_symlink() else Path(os.path.abspath(path))  # "." has no name to put beside
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}{suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed process of the same pid
    tmp.mkdir()
    try:
        write(tmp)
        if path.is_dir():
            shutil.copymode(path, tmp)
        fsync_tree(tmp)
        put_in_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)


def _is_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _remove(old: Path) -> None:
    """Remove a replaced file or folder; one that cannot be removed is named in a warning (the new one is in place)."""
    if _is_folder(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
    if old.exists() or old.is_symlink():
        log.warning(f"could not remove {old}, what it replaced; delete it by hand")
