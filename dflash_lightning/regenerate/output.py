"""The output of `regenerate`: JSONL lines in source order (and a rejects file), written in that order whatever
order the records finish in, so that a resumed run neither duplicates nor loses one; the settings check.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dflash_lightning.data.conversations import DataError, Message

log = logging.getLogger(__name__)

INDEX_KEY = "source_index"  # every output line carries the index of its source record: resume and order rely on it
# Settings that change what is generated: a resumed run must use the same ones as the lines already written.
# `server` is the engine the OpenAI-compatible servers report for the model (`owned_by` of /v1/models).
SETTINGS = ("input_files", "target", "format", "enable_thinking", "max_new_tokens", "temperature", "top_p", "top_k",
            "seed", "stop", "backend", "server")
# What a settings file written before a setting existed meant by its absence.
SETTING_DEFAULTS: dict[str, Any] = {"stop": None, "backend": "hf", "server": None}
# (index, location, source record, its messages to regenerate)
Conversation = tuple[int, str, dict[str, Any], list[Message]]


# ------------------------------------------------------------------------------------------ resuming


def _complete_lines(path: Path) -> Iterator[tuple[int, int, int]]:
    """`(line number, source index, end offset)` of each complete line of a file regenerate wrote."""
    with path.open("rb") as f:
        offset = 0
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                return  # written in part: a kill mid-write
            try:
                index = json.loads(line)[INDEX_KEY]
            except (ValueError, KeyError, TypeError) as err:
                raise DataError(f"{path}:{number}", f"not a line written by regenerate (no '{INDEX_KEY}')",
                                repr(err)) from err
            offset += len(line)
            yield number, index, offset


def resume_point(out: Path) -> int:
    """Index of the first source record not yet in `out`; a torn last line (a kill mid-write) is cut off first."""
    if not out.exists():
        return 0
    last, kept = -1, 0
    for number, index, offset in _complete_lines(out):
        if not isinstance(index, int) or index <= last:
            raise DataError(f"{out}:{number}", f"'{INDEX_KEY}' {index!r} does not follow {last}")
        last, kept = index, offset
    size = out.stat().st_size
    if kept < size:
        log.warning(f"{out}: cut a torn last line of {size - kept} bytes; its record is generated again")
        os.truncate(out, kept)
    return last + 1


def trim_rejects(rejects: Path, start: int) -> None:
    """Cut the rejects of source records >= `start` from the rejects file: those records are generated again."""
    if not rejects.exists():
        return
    kept = 0
    for _, index, offset in _complete_lines(rejects):
        if not isinstance(index, int) or index >= start:
            break
        kept = offset
    os.truncate(rejects, kept)


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Write the generation settings beside `out`, or refuse to append to lines made with other settings."""
    path = out.parent / f".{out.name}.regenerate.json"  # hidden, so that a `*.json` data glob does not take it
    if path.exists() and out.exists() and out.stat().st_size > 0:
        old = json.loads(path.read_text())
        for key in SETTINGS:
            before = old.get(key, SETTING_DEFAULTS.get(key))
            if before != settings[key]:
                raise ValueError(f"{out} was written with {key}={before!r}, now {key}={settings[key]!r}; "
                                 "use the same settings to resume, or another --out")
    path.write_text(json.dumps(settings, indent=1))


class OrderedWriter:
    """Writes each source record's outcome in source order, whatever order they finish in: a line of `out`, or a
    line of the rejects file with the reason for a record that has none. Resume relies on that order."""

    SYNC_EVERY_S = 1.0  # fsync at most this often: a finished record survives a crash of the machine

    def __init__(self, out: Path, rejects: Path, start: int, counts: Counter[str]) -> None:
        self.next = start  # the first source index not yet written
        self.counts, self.rejects_path = counts, rejects
        self.on_advance: Callable[[], None] = lambda: None
        self._waiting: dict[int, tuple[bool, str]] = {}  # index -> (is a reject, line), finished ahead of `next`
        self._out, self._rejects = out.open("ab"), rejects.open("ab")
        self._synced = time.monotonic()

    def finish(self, index: int, location: str, record: dict[str, Any], messages: list[Message]) -> None:
        """The regenerated conversation of a record; one with an empty answer is rejected (training refuses it)."""
        if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
            self.reject(index, location, "empty answer", record=record)
            return
        extra = {k: v for k, v in record.items() if k not in ("messages", "conversations", INDEX_KEY)}
        self._put(index, False, json.dumps({**extra, "messages": messages, INDEX_KEY: index}, ensure_ascii=False))

    def reject(self, index: int, location: str, reason: str, detail: str = "", record: Any = None) -> None:
        """A record that yields no line; `reason` is short and counted, `detail` says more."""
        self.counts[f"rejected: {reason}"] += 1
        entry = {INDEX_KEY: index, "location": location, "reason": reason, "detail": detail,
                 "record": record if isinstance(record, dict) else None}
        self._put(index, True, json.dumps(entry, ensure_ascii=False))

    def _put(self, index: int, is_reject: bool, line: str) -> None:
        self._waiting[index] = (is_reject, line)
        rejects, lines = [], []
        while self.next in self._waiting:
            is_reject, line = self._waiting.pop(self.next)
            (rejects if is_reject else lines).append(line + "\n")
            self.next += 1
        if rejects:  # on disk before any later line of `out`, so that resume never trims a reject it keeps
            self._write(self._rejects, rejects, sync=True)
        if lines:
            self.counts["written"] += len(lines)
            self._write(self._out, lines, sync=time.monotonic() - self._synced > self.SYNC_EVERY_S)
        if rejects or lines:
            self.on_advance()

    def _write(self, f: Any, lines: list[str], sync: bool) -> None:
        f.write("".join(lines).encode())
        f.flush()  # in the page cache: survives a kill of this process
        if sync:
            os.fsync(f.fileno())
            self._synced = time.monotonic()

    def close(self) -> None:
        """Flush and sync both files."""
        for f in (self._rejects, self._out):
            f.flush()
            os.fsync(f.fileno())
            f.close()

    def __enter__(self) -> OrderedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Conversation", "OrderedWriter", "check_settings", "resume_point", "trim_rejects"]
