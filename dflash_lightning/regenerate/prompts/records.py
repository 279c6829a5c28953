"""A prompt record as the builder writes it (`id`, `category`, `messages` ending in a user turn), its
deduplication key, and the gzip JSONL files that hold the records, written byte for byte the same on every run.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Message = dict[str, str]


@dataclass
class Prompt:
    """One record: the conversation so far, ending in the user turn the target is to answer."""

    id: str
    category: str  # the source's name: evaluate reports tau per category
    messages: list[Message]
    reference: str | None = field(default=None, repr=False)  # a known answer (follow-ups continue it); not written

    def record(self) -> dict[str, Any]:
        """The JSON object of a line (what regenerate and evaluate read)."""
        return {"id": self.id, "category": self.category, "messages": self.messages}


def user_prompt(pid: str, category: str, text: str, reference: str | None = None) -> Prompt:
    """A one-turn record."""
    return Prompt(pid, category, [{"role": "user", "content": text}], reference)


_SPACE = re.compile(r"\s+")


def dedup_key(messages: list[Message]) -> str:
    """What makes two records the same prompt: their user turns, lower-cased, whitespace collapsed."""
    return "\n".join(_SPACE.sub(" ", m["content"]).strip().lower() for m in messages if m["role"] == "user")


def key_hash(key: str) -> int:
    """A stable 64-bit hash of a dedup key (the held-out split and the ids use it; Python's `hash` is salted)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def write_jsonl_gz(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """gzip JSONL with no file name or time in its header, so a rebuild writes the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
        for record in records:
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
    tmp.replace(path)


def read_jsonl_gz(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a gzip JSONL file; a line that is not a JSON object is an error naming the file and line."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from err
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            yield record


def sha256_file(path: Path) -> str:
    """The file's sha256, as the manifest records it."""
    return hashlib.sha256(path.read_bytes()).hexdigest()
