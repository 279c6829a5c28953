"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one.

The temporary file lives beside the final path (same filesystem), so the rename is atomic.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    """A JSON file written atomically."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))
