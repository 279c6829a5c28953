"""Conversation files (JSONL, Parquet, Hugging Face `save_to_disk` folders) -> validated chat messages ->
token ids with a loss mask on exactly the assistant turns, rendered by the target's chat template.
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import os
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

RecordFormat = Literal["auto", "messages", "sharegpt"]
BadRecordPolicy = Literal["error", "skip"]
Message = dict[str, str]

JSONL_SUFFIXES = (".jsonl", ".json")
GZIP_SUFFIX = ".gz"  # x.jsonl.gz: gzip JSONL, read as it streams (the committed prompt files)
PARQUET_SUFFIXES = (".parquet",)
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
FORMAT_KEYS = {"messages": ("messages", "role", "content"), "sharegpt": ("conversations", "from", "value")}
CONVERSATION_COLUMNS = tuple(key for key, _, _ in FORMAT_KEYS.values())


class DataError(ValueError):
    """A data file or record that cannot be used; the message starts with the file and line (or row)."""

    def __init__(self, location: str, reason: str, detail: str = "") -> None:
        self.location = location
        self.reason = reason  # short and stable: records skipped with on_bad_record="skip" are counted by it
        super().__init__(f"{location}: {reason}" + (f" ({detail})" if detail else ""))


# ---------------------------------------------------------------------------------------------- files


def resolve_files(paths: Sequence[str], argument: str) -> list[Path]:
    """Expands globs and checks that every path exists and is a readable kind; errors name `argument`."""
    found: list[Path] = []
    for pattern in paths:
        if any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise DataError(pattern, f"{argument}: no file matches this pattern")
            found.extend(Path(m) for m in matches)
        elif Path(pattern).exists():
            found.append(Path(pattern))
        else:
            raise DataError(pattern, f"{argument}: file does not exist")
    for path in found:
        if path.is_dir():
            _arrow_files(path)  # raises unless it is a `save_to_disk` dataset folder
        elif path.suffix not in JSONL_SUFFIXES + PARQUET_SUFFIXES and not _is_gzip_jsonl(path):
            raise DataError(
                str(path), f"{argument}: unsupported file type",
                "expected .jsonl/.json (or .jsonl.gz), .parquet or a dataset folder",
            )
    return found


def _arrow_files(folder: Path) -> list[Path]:
    """The `*.arrow` shards of a `datasets.Dataset.save_to_disk` folder, in the order `state.json` lists them."""
    if (folder / "dataset_dict.json").exists():
        raise DataError(str(folder), "is a DatasetDict folder", f"pass one split folder, e.g. {folder / 'train'}")
    state = folder / "state.json"
    if state.exists():
        try:
            names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(str(state), "unreadable state.json", repr(err)) from err
        shards = [folder / name for name in names]
    else:
        shards = sorted(folder.glob("*.arrow"))
    if not shards or not (state.exists() or (folder / "dataset_info.json").exists()):
        raise DataError(
            str(folder), "is not a Hugging Face save_to_disk dataset folder", "for a folder of files use a glob"
        )
    for shard in shards:
        if not shard.exists():
            raise DataError(str(shard), "file does not exist", f"listed in {state}")
    return shards


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    """Yields `(location, record)` for every record of a file; an unreadable record comes as a `DataError`."""
    if path.is_dir():
        for shard in _arrow_files(path):
            yield from _iter_table(shard, _arrow_batches(shard))
    elif path.suffix in PARQUET_SUFFIXES:
        yield from _iter_table(path, _parquet_batches(path))
    else:
        yield from _iter_jsonl(path)


def iter_full_records(path: Path) -> Iterator[tuple[str, Any]]:
    """`(location, record)` of every record with all its keys (`iter_records` keeps only the conversation)."""
    if path.is_dir() or path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        shards = _arrow_files(path) if path.is_dir() else [path]
        number = 0
        for shard in shards:
            batches = _arrow_batches(shard) if path.is_dir() else pq.ParquetFile(shard).iter_batches(batch_size=1024)
            for batch in batches:
                for record in batch.to_pylist():
                    number += 1
                    yield f"{shard}:row {number}", record
    else:
        yield from iter_records(path)


def count_records(path: Path) -> int:
    """How many records `iter_full_records` yields, cheaply (for the progress bar)."""
    if path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.is_dir():
        return sum(b.num_rows for shard in _arrow_files(path) for b in _arrow_batches(shard))
    with _open_jsonl(path) as f:
        return sum(1 for line in f if line.strip())


def _is_gzip_jsonl(path: Path) -> bool:
    return path.suffix == GZIP_SUFFIX and Path(path.stem).suffix in JSONL_SUFFIXES


def _open_jsonl(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if _is_gzip_jsonl(path) else path.open("rb")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with _open_jsonl(path) as f:  # bytes, so that invalid UTF-8 is reported per line rather than per file
        for number, raw in enumerate(f, start=1):
            location = f"{path}:{number}"
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8").lstrip("\ufeff")
            except UnicodeDecodeError as err:
                yield location, DataError(location, "invalid UTF-8", str(err))
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                hint = "; a file must hold one JSON object per line" if text.lstrip().startswith("[") else ""
                record = DataError(location, "malformed JSON", f"{err.msg} at column {err.colno}{hint}")
            yield location, record


def _parquet_batches(path: Path) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        columns = [c for c in CONVERSATION_COLUMNS if c in file.schema_arrow.names]  # skip unused wide columns
        yield from file.iter_batches(batch_size=1024, columns=columns or None)
    except (OSError, pa.ArrowException) as err:
        raise DataError(str(path), "unreadable Parquet file", str(err)) from err


def _arrow_batches(path: Path) -> Iterator[Any]:
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            try:
                batches: Iterator[Any] = iter(pa.ipc.open_stream(source))  # the format `datasets` writes
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            yield from batches
    except (OSError, pa.ArrowException) as err:
        raise DataError(str(path), "unreadable Arrow file", str(err)) from err


def _iter_table(path: Path, batches: Iterator[Any]) -> Iterator[tuple[str, Any]]:
    number = 0
    for batch in batches:
        present = [c for c in CONVERSATION_COLUMNS if c in batch.schema.names]
        if not present:
            raise DataError(str(path), "has neither a 'messages' nor a 'conversations' column")
        for record in batch.select(present).to_pylist():
            number += 1
            yield f"{path}:row {number}", record


# ------------------------------------------------------------------------------------------- records


def to_messages(record: Any, fmt: RecordFormat, location: str) -> list[Message]:
    """Validates one record and returns its turns as `{"role", "content"}` with roles system/user/assistant."""
    if not isinstance(record, dict):
        raise DataError(location, "record is not an object", f"got {type(record).__name__}")
    detected = fmt
    if fmt == "auto":
        detected = next((f for f, (key, _, _) in FORMAT_KEYS.items() if record.get(key) is not None), "messages")
    key, role_key, text_key = FORMAT_KEYS[detected]
    turns = record.get(key)
    if not isinstance(turns, list):
        expected = "'messages' or 'conversations'" if fmt == "auto" else f"'{key}'"
        raise DataError(location, "no conversation", f"expected a list under {expected}")
    names = SHAREGPT_ROLES if detected == "sharegpt" else {r: r for r in ROLES}
    messages: list[Message] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(location, "turn is not an object", f"turn {k}")
        raw_role = turn.get(role_key)
        if raw_role is None:
            raise DataError(location, "missing role", f"turn {k} has no '{role_key}'")
        role = names.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise DataError(location, "unknown role", f"turn {k}: {raw_role!r}, expected one of {list(names)}")
        content = turn.get(text_key)
        if content is not None and not isinstance(content, str):
            raise DataError(location, "content is not a string", f"turn {k}: {type(content).__name__}")
        if role == "assistant" and not (content or "").strip():
            raise DataError(location, "empty assistant turn", f"turn {k}")
        if content is None:
            raise DataError(location, "missing content", f"turn {k} has no '{text_key}'")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(location, "no assistant turn")
    return messages


# ---------------------------------------------------------------------------------------- tokenizing


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    """Raises unless the tokenizer has a chat template and character offsets (a fast tokenizer)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(name, "tokenizer has no chat_template", "the loss mask is placed by rendering the template")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(name, "tokenizer is not a fast tokenizer", "offset mappings are needed to place the loss mask")


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    location: str,
    max_length: int,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], Tensor]:
    """Token ids of the rendered conversation (first `max_length`) and its loss mask (bool [tokens]).

    The mask covers each assistant turn from its content through the template's end-of-turn token(s):
    the text between `messages[:i]` rendered with the generation prompt and `messages[:i+1]` rendered,
    without trailing whitespace (the newline between turns is never generated before the model stops).
    """
    kwargs = template_kwargs or {}

    def render(turns: list[Message], generation_prompt: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
            )
        except Exception as err:  # jinja raises anything, e.g. a template's own raise_exception
            raise DataError(location, "chat template failed", f"{type(err).__name__}: {err}") from err
        assert isinstance(text, str)
        return text

    text = render(messages, False)
    spans: list[tuple[int, int]] = []  # character spans of the assistant turns in `text`
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        through = text if i == len(messages) - 1 else render(messages[: i + 1], False)
        if through.startswith(before) and text.startswith(through):
            spans.append((len(before), max(len(before), len(through.rstrip()))))
        else:  # the template rewrites earlier turns (Qwen3 drops their <think> blocks): find the turn itself
            spans.append(_locate_turn(render, messages, i, text, through, location))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"][:max_length])
    offsets = torch.tensor(encoding["offset_mapping"][:max_length], dtype=torch.int64).reshape(-1, 2)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for start, end in spans:
        mask |= (offsets[:, 0] >= start) & (offsets[:, 1] <= end)
    return ids, mask


def _locate_turn(render, messages: list[Message], i: int, text: str, through: str, location: str) -> tuple[int, int]:
    """Span of assistant turn `i` in the whole rendered `text`, for templates that are not prefix-consistent.

    Rendering the conversation again with a stand-in content for that turn changes exactly the characters of
    its content; the template's end-of-turn marker (what follows the content when the turn is last) is added.
    """
    content = messages[i]["content"]
    probe = render([*messages[:i], {**messages[i], "content": "\x00"}, *messages[i + 1 :]], False)
    start = len(os.path.commonprefix([text, probe]))
    suffix = len(os.path.commonprefix([text[start:][::-1], probe[start:][::-1]]))
    end = len(text) - suffix
    tail = through.rfind(content)
    marker = through[tail + len(content) :].rstrip() if tail >= 0 else ""
    if end <= start or text[start:end] != content or not text.startswith(marker, end):
        raise DataError(location, "chat template is not prefix-consistent",
                        f"turn {i}: its content cannot be located in the rendered conversation")
    return start, end + len(marker)


@dataclass
class TokenizedSamples:
    """Tokenized documents stored flat: document i is `input_ids[starts[i]:starts[i + 1]]`."""

    input_ids: Tensor  # int32 [total tokens]
    loss_mask: Tensor  # bool [total tokens]
    starts: Tensor  # int64 [documents + 1]
    counts: dict[str, int] = field(default_factory=dict)  # read / kept / truncated
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> number of records
    first_dropped: dict[str, str] = field(default_factory=dict)  # reason -> location of the first one
    # where document i came from: `sources[doc_source[i]] + str(doc_record[i])`, e.g. "train.jsonl:12"
    sources: list[str] = field(default_factory=list)  # location prefixes, "a.jsonl:" or "b.parquet:row "
    doc_source: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # [documents]
    doc_record: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [documents]

    def __len__(self) -> int:
        return self.starts.numel() - 1

    def lengths(self) -> list[int]:
        """Token count of every document."""
        return self.starts.diff().tolist()

    def document(self, i: int) -> tuple[Tensor, Tensor]:
        """`(input_ids, loss_mask)` of document i, as views."""
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]

    def location(self, i: int) -> str:
        """File and line (or row) of document i's record; its index if the samples predate locations."""
        if i >= self.doc_source.numel():
            return f"sample {i}"
        return f"{self.sources[int(self.doc_source[i])]}{int(self.doc_record[i])}"

    def find(self, token_id: int) -> str | None:
        """The location of the first document holding `token_id`, or None where none does."""
        hits = (self.input_ids == token_id).nonzero()
        if not hits.numel():
            return None
        return self.location(int(torch.searchsorted(self.starts, hits[0, 0].long(), right=True)) - 1)

    def report(self, name: str, min_supervised: int) -> str:
        """One line: what was kept, truncated and dropped, and why."""
        kept, read = self.counts.get("kept", 0), self.counts.get("read", 0)
        supervised = int(self.loss_mask.sum())
        line = (
            f"{name}: kept {kept:,} of {read:,} records, {self.input_ids.numel():,} tokens "
            f"({supervised / max(1, self.input_ids.numel()):.1%} supervised); "
            f"{self.counts.get('truncated', 0):,} truncated to max_length"
        )
        if self.dropped:
            parts = [f"{n:,} {reason} (first: {self.first_dropped[reason]})" for reason, n in self.dropped.items()]
            line += "; dropped " + ", ".join(parts)
        return line


def too_few_supervised(min_supervised: int) -> str:
    """The drop reason of samples with too few supervised tokens (`data.min_supervised_tokens`)."""
    return f"fewer than {min_supervised} supervised tokens (min_supervised_tokens)"


def tokenize_files(
    files: Sequence[Path],
    tokenizer: PreTrainedTokenizerBase,
    tokenizer_name: str,
    fmt: RecordFormat,
    enable_thinking: bool | None,
    max_length: int,
    min_supervised: int,
    on_bad_record: BadRecordPolicy,
) -> TokenizedSamples:
    """Reads, validates and tokenizes every record; bad records raise or are counted, short ones are counted."""
    check_tokenizer(tokenizer, tokenizer_name)
    template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    input_ids, loss_mask, starts = array("i"), array("b"), [0]
    sources: dict[str, int] = {}
    doc_source, doc_record = array("i"), array("q")
    counts: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    first_dropped: dict[str, str] = {}
    for path in files:
        for location, record in iter_records(path):
            counts["read"] += 1
            try:
                if isinstance(record, DataError):
                    raise record
                messages = to_messages(record, fmt, location)
                ids, mask = tokenize_conversation(tokenizer, messages, location, max_length + 1, template_kwargs)
            except DataError as err:
                if on_bad_record == "error":
                    raise
                reason = f"bad record: {err.reason}"
            else:
                counts["truncated"] += int(len(ids) > max_length)
                ids, mask = ids[:max_length], mask[:max_length]
                reason = "" if int(mask.sum()) >= min_supervised else too_few_supervised(min_supervised)
            if reason:
                dropped[reason] += 1
                first_dropped.setdefault(reason, location)
                continue
            counts["kept"] += 1
            prefix, number = _split_location(location)
            doc_source.append(sources.setdefault(prefix, len(sources)))
            doc_record.append(number)
            input_ids.extend(ids)
            loss_mask.extend(mask.tolist())
            starts.append(len(input_ids))
    return TokenizedSamples(
        input_ids=_as_tensor(input_ids, torch.int32),
        loss_mask=_as_tensor(loss_mask, torch.int8).bool(),
        starts=torch.tensor(starts, dtype=torch.int64),
        counts=dict(counts),
        dropped=dict(dropped),
        first_dropped=first_dropped,
        sources=list(sources),
        doc_source=_as_tensor(doc_source, torch.int32),
        doc_record=_as_tensor(doc_record, torch.int64),
    )


def _split_location(location: str) -> tuple[str, int]:
    """`"a.jsonl:12"` -> `("a.jsonl:", 12)`; `"b.parquet:row 7"` -> `("b.parquet:row ", 7)`."""
    digits = len(location) - len(location.rstrip("0123456789"))
    return location[: len(location) - digits], int(location[len(location) - digits:] or 0)


def _as_tensor(buffer: array, dtype: torch.dtype) -> Tensor:
    # frombuffer shares the array's memory (and keeps it alive); torch.tensor(array) is ~50x slower
    return torch.frombuffer(buffer, dtype=dtype) if len(buffer) else torch.zeros(0, dtype=dtype)
