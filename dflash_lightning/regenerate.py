"""Rewrite the assistant turns of conversation files with the target itself (DFLASH.md section 4), so that
the drafter learns what the target says; writes resumable JSONL in the `messages` format, in source order.

`python -m dflash_lightning regenerate --input_files data/*.jsonl --out train.jsonl --target Qwen/Qwen3-8B`
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from dflash_lightning.data.conversations import (
    FORMAT_KEYS,
    PARQUET_SUFFIXES,
    DataError,
    Message,
    _arrow_batches,
    _arrow_files,
    iter_records,
    resolve_files,
    to_messages,
)
from dflash_lightning.target import DTYPES, resolve_model_dir

log = logging.getLogger(__name__)

INDEX_KEY = "source_index"  # every output line carries the index of its source record: resume and order rely on it
# Settings that change what is generated: a resumed run must use the same ones as the lines already written.
SETTINGS = ("input_files", "target", "format", "enable_thinking", "max_new_tokens", "temperature", "top_p", "top_k",
            "seed")


# ------------------------------------------------------------------------------------------- reading


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
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def conversation(record: Any, fmt: Literal["auto", "messages", "sharegpt"], location: str) -> list[Message]:
    """The record's turns as messages; a conversation that ends with a user turn gets an assistant turn to write."""
    try:
        messages = to_messages(record, fmt, location)
    except DataError as err:
        if err.reason != "no assistant turn":
            raise
        # a prompt-only record: validate it with a stand-in answer, then leave the answer to the target
        detected = fmt if fmt != "auto" else next((f for f, (k, _, _) in FORMAT_KEYS.items() if record.get(k)), fmt)
        key, role_key, text_key = FORMAT_KEYS["messages" if detected == "auto" else detected]
        padded = {**record, key: [*record[key], {role_key: "assistant", text_key: "-"}]}
        messages = to_messages(padded, fmt, location)[:-1]
    if messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": ""})
    return messages


# ------------------------------------------------------------------------------------------ resuming


def resume_point(out: Path) -> int:
    """Index of the first source record not yet in `out`; a torn last line (a kill mid-write) is cut off first."""
    if not out.exists():
        return 0
    last, kept = -1, 0
    with out.open("r+b") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # written in part: the record is generated again
            try:
                index = json.loads(line)[INDEX_KEY]
            except (ValueError, KeyError, TypeError) as err:
                raise DataError(f"{out}:{number}", f"not a line written by regenerate (no '{INDEX_KEY}')",
                                repr(err)) from err
            if not isinstance(index, int) or index <= last:
                raise DataError(f"{out}:{number}", f"'{INDEX_KEY}' {index!r} does not follow {last}")
            last, kept = index, kept + len(line)
        size = f.seek(0, os.SEEK_END)
        if kept < size:
            log.warning(f"{out}: cut a torn last line of {size - kept} bytes; its record is generated again")
            f.truncate(kept)
    return last + 1


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Write the generation settings beside `out`, or refuse to append to lines made with other settings."""
    path = out.parent / f".{out.name}.regenerate.json"  # hidden, so that a `*.json` data glob does not take it
    if path.exists() and out.exists() and out.stat().st_size > 0:
        old = json.loads(path.read_text())
        for key in SETTINGS:
            if old.get(key) != settings[key]:
                raise ValueError(f"{out} was written with {key}={old.get(key)!r}, now {key}={settings[key]!r}; "
                                 "use the same settings to resume, or another --out")
    path.write_text(json.dumps(settings, indent=1))


# ---------------------------------------------------------------------------------------- generating


def generate_turns(model: Any, tokenizer: Any, prompts: list[list[Message]], options: dict[str, Any],
                   template_kwargs: dict[str, Any], stop_ids: list[int]) -> list[tuple[str, bool]]:
    """`(text, truncated)` of the target's answer to each prompt, generated as one left-padded batch."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **template_kwargs)
             for p in prompts]
    # the template holds any BOS itself, as in evaluate.prompt_ids
    encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
    out = model.generate(**encoded, **options)
    answers = []
    for row in out[:, encoded["input_ids"].shape[1]:].tolist():
        end = next((k for k, t in enumerate(row) if t in stop_ids), None)
        answers.append((tokenizer.decode(row[:end], skip_special_tokens=True), end is None))
    return answers


def regenerate_batch(model: Any, tokenizer: Any, batch: list[list[Message]], options: dict[str, Any],
                     template_kwargs: dict[str, Any], stop_ids: list[int], counts: Counter[str]) -> None:
    """Rewrites every assistant turn of the conversations in place, turn by turn: turn k sees the new turns < k."""
    slots = [[i for i, m in enumerate(msgs) if m["role"] == "assistant"] for msgs in batch]
    for turn in range(max(map(len, slots))):
        todo = [(msgs, s[turn]) for msgs, s in zip(batch, slots, strict=True) if turn < len(s)]
        answers = generate_turns(model, tokenizer, [msgs[:i] for msgs, i in todo], options, template_kwargs, stop_ids)
        for (msgs, i), (text, truncated) in zip(todo, answers, strict=True):
            msgs[i] = {"role": "assistant", "content": text}
            counts["turns"] += 1
            counts["truncated turns"] += truncated


def regenerate(
    *,
    input_files: list[str],
    out: str,
    target: str,
    format: Literal["auto", "messages", "sharegpt"] = "auto",
    enable_thinking: bool | None = False,
    max_new_tokens: int = 2048,
    batch_size: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    device: str = "auto",
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
    limit: int | None = None,
    on_bad_record: Literal["error", "skip"] = "error",
    progress: bool = True,
) -> Path:
    """Rewrite every assistant turn of conversation files with the target, batched; resumes where `out` ends.

    Output lines are `{..extra keys.., "messages": [...], "source_index": i}` in source order. A final user
    turn is answered too. A conversation whose new answer is empty is dropped (the data stage refuses them).

    Args:
        input_files: Conversations: .jsonl/.json, .parquet, `save_to_disk` folders or globs (as for training).
        out: JSONL file to write; if it exists, generation continues after its last complete line.
        target: Hugging Face folder or hub id of the target that writes the answers.
        format: Record format: OpenAI "messages", ShareGPT "conversations", or "auto" per record.
        enable_thinking: Passed to the chat template (Qwen3); None: not passed. The recipe trains thinking off.
        max_new_tokens: Most tokens per generated turn; longer answers are cut (and counted).
        batch_size: Conversations generated together (left-padded).
        temperature: 0: greedy decoding; > 0: sampling at this temperature.
        top_p: Nucleus sampling threshold when sampling.
        top_k: Top-k sampling when sampling; 0: off.
        seed: Sampling seed; batch starting at source index i samples with seed + i.
        device: Device of the target: "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
        dtype: Dtype of the target.
        limit: Only the first `limit` source records (counting those already done); None: all.
        on_bad_record: "error" raises on a bad record; "skip" leaves it out and counts it.
        progress: Show a progress bar.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_lightning.evaluate import stop_token_ids

    if batch_size < 1 or max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"need batch_size >= 1, max_new_tokens >= 1, temperature >= 0; got {batch_size}, "
                         f"{max_new_tokens}, {temperature}")
    files = resolve_files(input_files, "input_files")
    out_path = Path(out)
    settings = {k: v for k, v in locals().items() if k in SETTINGS}
    settings["input_files"] = [str(p) for p in files]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    start = resume_point(out_path)
    check_settings(out_path, settings)

    folder = resolve_model_dir(target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"  # generation continues every row at the same column
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to(device).eval()
    stop_ids = stop_token_ids(tokenizer, model)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k or None}
    greedy = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    options = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": stop_ids,
               **(sampling if temperature > 0 else greedy)}
    template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    total = sum(count_records(p) for p in files)
    end = total if limit is None else min(limit, total)
    counts: Counter[str] = Counter()

    def pending() -> Iterator[tuple[int, str, Any]]:
        index = 0
        for path in files:
            for location, record in iter_full_records(path):
                if index >= end:
                    return
                if index >= start:
                    yield index, location, record
                index += 1

    def flush(batch: list[tuple[int, dict[str, Any], list[Message]]], f: Any) -> None:
        torch.manual_seed(seed + batch[0][0])  # sampling is reproducible per batch, also after a resume
        regenerate_batch(model, tokenizer, [m for _, _, m in batch], options, template_kwargs, stop_ids, counts)
        lines = []
        for index, record, messages in batch:
            if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
                counts["dropped: empty answer"] += 1
                continue
            extra = {k: v for k, v in record.items() if k not in ("messages", "conversations", INDEX_KEY)}
            lines.append(json.dumps({**extra, "messages": messages, INDEX_KEY: index}, ensure_ascii=False) + "\n")
        f.write("".join(lines).encode())
        f.flush()
        os.fsync(f.fileno())  # a finished batch survives a crash; a later kill can tear at most the next write

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not progress) as bar, out_path.open("ab") as f:
        task = bar.add_task("regenerating", total=max(0, end - start))
        batch: list[tuple[int, dict[str, Any], list[Message]]] = []
        for index, location, record in pending():
            try:
                if isinstance(record, DataError):
                    raise record
                batch.append((index, record, conversation(record, format, location)))
            except DataError as err:
                if on_bad_record == "error":
                    raise
                counts[f"skipped: {err.reason}"] += 1
                bar.update(task, advance=1)
            if len(batch) == batch_size:
                flush(batch, f)
                bar.update(task, advance=len(batch))
                batch = []
        if batch:
            flush(batch, f)
            bar.update(task, advance=len(batch))
    summary = ", ".join(f"{n:,} {what}" for what, n in sorted(counts.items()))
    print(f"regenerated source records {start:,}..{end - 1:,} into {out_path}: {summary or 'nothing to do'}")
    return out_path


__all__ = ["conversation", "regenerate", "regenerate_batch", "resume_point"]
