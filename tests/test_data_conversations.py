"""Reading, validation and chat-template tokenization of conversations, with the loss mask checked token
by token against a mask built independently from the template's pieces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_lightning.data.conversations import DataError, count_records, resolve_files, tokenize_files
from dflash_lightning.decoding.evaluate import read_prompts

# ChatML; with enable_thinking=false an empty think block opens every assistant turn (as Qwen3 does), so it
# belongs to the generation prompt and must not be supervised
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# renders the first user turn differently once an assistant reply follows: not prefix-consistent
INCONSISTENT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.first and messages | length > 1 %} (answered){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(folder: Path, template: str | None = CHATML) -> Path:
    """A byte-level ChatML tokenizer with no merges (one token per byte, plus specials), saved to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens(["<think>", "</think>"])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


def load(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tok(tok_dir):
    return load(tok_dir)


def chat(i: int, reply: int = 20, turns: int = 1, system: bool = False) -> list[dict[str, str]]:
    """A conversation whose assistant replies have `reply` characters (= tokens for ASCII)."""
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {i}.{t}?"})
        messages.append({"role": "assistant", "content": (f"answer {i}.{t} " + "x" * reply)[:reply]})
    return messages


def sharegpt(messages: list[dict[str, str]]) -> dict:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def write_hf_folder(folder: Path, records: list[dict], shards: int = 1) -> Path:
    """A `datasets.save_to_disk` folder: IPC-stream `.arrow` shards plus dataset_info.json and state.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(records)
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    per = -(-len(records) // shards)
    for k, name in enumerate(names):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(k * per, per), max_chunksize=2)
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    return folder


def expected(tok, messages: list[dict[str, str]], thinking: bool | None = None) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask built piece by piece: content and <|im_end|> of assistant turns supervised."""
    ids: list[int] = []
    mask: list[bool] = []

    def add(text: str, supervised: bool) -> None:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([supervised] * len(piece))

    for m in messages:
        assistant = m["role"] == "assistant"
        add(f"<|im_start|>{m['role']}\n", False)
        if assistant and thinking is False:
            add("<think>\n\n</think>\n\n", False)
        add(m["content"], assistant)
        add("<|im_end|>", assistant)
        add("\n", False)
    return ids, mask


def tokenize(tok, files, fmt="auto", thinking=None, max_length=10_000, min_supervised=8, on_bad="error"):
    return tokenize_files(
        [Path(f) for f in files], tok, "tok", fmt, thinking, max_length, min_supervised, on_bad
    )


def documents(samples) -> list[tuple[list[int], list[bool]]]:
    out = []
    for i in range(len(samples)):
        ids, mask = samples.document(i)
        out.append((ids.tolist(), mask.tolist()))
    return out


def test_messages_jsonl_multi_turn_mask_token_by_token(tok, tmp_path):
    convs = [chat(0, system=True), chat(1, turns=3), chat(2, reply=40, turns=2, system=True)]
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": c, "category": "x"} for c in convs])
    samples = tokenize(tok, [path])
    assert documents(samples) == [expected(tok, c) for c in convs]
    assert samples.counts == {"read": 3, "kept": 3, "truncated": 0}
    assert samples.input_ids.dtype == torch.int32 and samples.loss_mask.dtype == torch.bool


def test_sharegpt_and_auto_and_json_suffix(tok, tmp_path):
    convs = [chat(0, system=True), chat(1, turns=2)]
    share = write_jsonl(tmp_path / "s.json", [sharegpt(c) for c in convs])
    mixed = write_jsonl(tmp_path / "m.jsonl", [sharegpt(convs[0]), {"messages": convs[1]}])
    want = [expected(tok, c) for c in convs]
    assert documents(tokenize(tok, [share], fmt="sharegpt")) == want
    assert documents(tokenize(tok, [share])) == want
    assert documents(tokenize(tok, [mixed])) == want
    with pytest.raises(DataError, match=r"s\.json:1: no conversation"):
        tokenize(tok, [share], fmt="messages")


def test_gzipped_jsonl_reads_as_the_plain_file(tok, tmp_path):
    """`x.jsonl.gz` is read, counted and located (file:line) as `x.jsonl`; so is a gzipped prompts file."""
    convs = [chat(0, system=True), chat(1, turns=2)]
    plain = write_jsonl(tmp_path / "a.jsonl", [{"messages": convs[0]}, '{"messages": [broken', {"messages": convs[1]}])
    packed = tmp_path / "a.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert resolve_files([str(packed)], "train_files") == [packed] and count_records(packed) == 3
    assert documents(tokenize(tok, [packed], on_bad="skip")) == [expected(tok, c) for c in convs]
    with pytest.raises(DataError, match=r"a\.jsonl\.gz:2: "):
        tokenize(tok, [packed])
    prompts = tmp_path / "p.jsonl.gz"
    prompts.write_bytes(gzip.compress(b'{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n'))
    assert [r.get("prompt") for r in read_prompts(prompts)] == ["a", None]
    (tmp_path / "x.txt.gz").write_bytes(gzip.compress(b"{}"))
    with pytest.raises(DataError, match="unsupported file type"):
        resolve_files([str(tmp_path / "x.txt.gz")], "train_files")


def test_unicode_offsets(tok, tmp_path):
    conv = [{"role": "user", "content": "Grüße 🙂?"}, {"role": "assistant", "content": "Schöne Grüße zurück 🙂 ok"}]
    path = write_jsonl(tmp_path / "u.jsonl", [{"messages": conv}])
    assert documents(tokenize(tok, [path])) == [expected(tok, conv)]


def test_parquet(tok, tmp_path):
    convs = [chat(i, turns=1 + i % 2) for i in range(5)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": c, "category": "c", "id": i} for i, c in enumerate(convs)]), path)
    assert documents(tokenize(tok, [path])) == [expected(tok, c) for c in convs]


def test_hf_save_to_disk_folder(tok, tmp_path):
    convs = [chat(i, turns=1 + i % 3, system=i % 2 == 0) for i in range(7)]
    folder = write_hf_folder(tmp_path / "ds", [sharegpt(c) | {"source": "s"} for c in convs], shards=3)
    assert documents(tokenize(tok, [folder])) == [expected(tok, c) for c in convs]
    assert resolve_files([str(folder)], "train_files") == [folder]


def test_arrow_ipc_file_format_and_missing_column(tok, tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    convs = [chat(i) for i in range(3)]
    table = pa.Table.from_pylist([{"messages": c} for c in convs])
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    (folder / "dataset_info.json").write_text("{}")  # no state.json: shards are found by name
    assert documents(tokenize(tok, [folder])) == [expected(tok, c) for c in convs]
    pq.write_table(pa.Table.from_pylist([{"text": "hi"}]), tmp_path / "plain.parquet")
    with pytest.raises(DataError, match="neither a 'messages' nor a 'conversations' column"):
        tokenize(tok, [tmp_path / "plain.parquet"])


def test_globs(tok, tmp_path):
    for k in range(3):
        write_jsonl(tmp_path / f"part{k}.jsonl", [{"messages": chat(k)}])
    files = resolve_files([str(tmp_path / "part*.jsonl")], "train_files")
    assert [f.name for f in files] == ["part0.jsonl", "part1.jsonl", "part2.jsonl"]
    assert documents(tokenize(tok, files)) == [expected(tok, chat(k)) for k in range(3)]


@pytest.mark.parametrize("thinking", [None, True, False])
def test_enable_thinking_reaches_the_template(tok, tmp_path, thinking):
    conv = chat(0, turns=2)
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": conv}])
    ids, mask = documents(tokenize(tok, [path], thinking=thinking))[0]
    assert (ids, mask) == expected(tok, conv, thinking)
    think = tok.convert_tokens_to_ids("<think>")
    assert (think in ids) == (thinking is False)


def test_truncation(tok, tmp_path):
    conv = chat(0, reply=60, turns=2)
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": conv}, {"messages": chat(1, reply=10)}])
    samples = tokenize(tok, [path], max_length=50)
    ids, mask = expected(tok, conv)
    assert len(ids) > 50
    assert documents(samples)[0] == (ids[:50], mask[:50])
    assert samples.counts["truncated"] == 1


def test_drop_rule_counts_short_samples(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": chat(i, reply=r)} for i, r in enumerate([30, 5, 12, 3])])
    samples = tokenize(tok, [path], min_supervised=12)  # a reply of r characters supervises r + 1 tokens
    assert len(samples) == 2
    reason = "fewer than 12 supervised tokens (min_supervised_tokens)"
    assert samples.dropped == {reason: 2}
    assert samples.first_dropped[reason] == f"{path}:2"
    assert reason in samples.report("train", 12)


BAD = {
    "malformed JSON": '{"messages": [',
    "invalid UTF-8": b'{"messages": [{"role": "user", "content": "\xff"}]}',
    "missing role": {"messages": [{"content": "hi"}, {"role": "assistant", "content": "hello there friend"}]},
    "unknown role": {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "hello there"}]},
    "empty assistant turn": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
    "no assistant turn": {"messages": [{"role": "user", "content": "hi"}]},
    "record is not an object": [1, 2],
    "no conversation": {"text": "hi"},
    "content is not a string": {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
}


def write_with_bad_line(path: Path, bad) -> Path:
    """Good record on line 1, an empty line 2, the bad record on line 3, a good record on line 4."""
    good = json.dumps({"messages": chat(0)}).encode()
    bad = bad if isinstance(bad, bytes) else (bad if isinstance(bad, str) else json.dumps(bad)).encode()
    path.write_bytes(b"\n".join([good, b"", bad, good]) + b"\n")
    return path


@pytest.mark.parametrize("reason", list(BAD))
def test_bad_record_names_file_and_line(tok, tmp_path, reason):
    path = write_with_bad_line(tmp_path / "bad.jsonl", BAD[reason])
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: {reason}") as info:
        tokenize(tok, [path])
    assert info.value.location == f"{path}:3" and info.value.reason == reason
    samples = tokenize(tok, [path], on_bad="skip")
    assert len(samples) == 2 and samples.dropped == {f"bad record: {reason}": 1}
    assert samples.first_dropped[f"bad record: {reason}"] == f"{path}:3"


def test_sharegpt_unknown_role_and_parquet_row(tok, tmp_path):
    path = tmp_path / "bad.parquet"
    rows = [sharegpt(chat(0)), {"conversations": [{"from": "bot", "value": "x"}, {"from": "gpt", "value": "yy"}]}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"bad\.parquet:row 2: unknown role \(turn 0: 'bot'"):
        tokenize(tok, [path])


def test_missing_files_and_bad_paths(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: train_files: file does not exist"):
        resolve_files([str(tmp_path / "nope.jsonl")], "train_files")
    with pytest.raises(DataError, match="no file matches"):
        resolve_files([str(tmp_path / "*.parquet")], "val_files")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported file type"):
        resolve_files([str(tmp_path / "notes.txt")], "train_files")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not a Hugging Face save_to_disk dataset"):
        resolve_files([str(tmp_path / "plain")], "train_files")
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text("{}")
    with pytest.raises(DataError, match="DatasetDict"):
        resolve_files([str(tmp_path / "dd")], "train_files")


def test_tokenizer_without_chat_template(tmp_path):
    tok = load(make_tokenizer(tmp_path / "plain_tok", template=None))
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": chat(0)}])
    with pytest.raises(DataError, match="no chat_template"):
        tokenize(tok, [path])


# Like Qwen3: the empty think block is rendered only in assistant turns after the last user message.
QWEN3_LIKE = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)


@pytest.mark.parametrize("template", [INCONSISTENT, QWEN3_LIKE])
def test_templates_that_rewrite_earlier_turns(tmp_path, template):
    """Multi-turn data with templates that are not prefix-consistent: each turn is located in the whole text."""
    tok = load(make_tokenizer(tmp_path / "odd_tok", template=template))
    conv = chat(0, turns=3)
    samples = tokenize(tok, [write_jsonl(tmp_path / "a.jsonl", [{"messages": conv}])])
    ids, mask = documents(samples)[0]
    text = tok.apply_chat_template(conv, tokenize=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    supervised = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert supervised == "".join(m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant")
