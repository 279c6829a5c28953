"""Build the tiny embedded DFlash assets: a small real Qwen3 target and licence-clean chat data.

Everything is made offline from text that ships with CPython (the language reference topics in
``pydoc_data.topics`` and the docstrings of a fixed list of standard-library modules; Python
Software Foundation License):

1. conversations in the OpenAI chat format, ~5% of them held out (whole conversations);
2. a byte-level BPE tokenizer with a Qwen-style ChatML chat template;
3. a small ``Qwen3ForCausalLM`` trained on the training conversations (AdamW, cosine schedule);
4. the training / held-out data regenerated with the trained target's own greedy responses.

Run ``python tools/build_tiny.py`` (defaults: ``--out dflash_lightning/assets/tiny
--minutes 2 --seed 0``). The number of optimizer steps is derived from ``--minutes`` through a fixed
calibration constant, never from the clock, so the output is reproducible for a given Python, torch
version, machine type and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_lightning.regenerate.prompts.python_docs import (
    ANSWER_CHARS,
    ASK_TEMPLATES,
    MIN_ANSWER_CHARS,
    MODULES,
    MORE_TEMPLATES,
    SIBLING_TEMPLATES,
    Item,
    collect_items,
    take,
)

# The package's assets folder; this script lives outside the package so that the wheel ships the assets only.
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "dflash_lightning" / "assets" / "tiny"

# ----------------------------------------------------------------------------- conversations (the text: python_docs.py)

HELD_OUT_MODULUS = 20  # crc32(id) % 20 == 0 -> held out (about 5%)
TWO_TURN_FRACTION = 0.2


@dataclass
class Conversation:
    """A chat conversation in OpenAI format plus bookkeeping."""

    id: str
    category: str
    messages: list[dict[str, str]]
    held_out: bool = False


def _is_held_out(item: Item) -> bool:
    """Held-out items (about 5%): crc32 of the id, so the choice does not depend on order or seed."""
    return zlib.crc32(item.id.encode()) % HELD_OUT_MODULUS == 0


def make_conversations(seed: int) -> list[Conversation]:
    """Turn the documented items into 1- and 2-turn chat conversations (deterministic in ``seed``)."""
    items = collect_items()
    rng = random.Random(seed)
    by_group: dict[str, list[Item]] = {}
    for item in items:
        by_group.setdefault(item.group, []).append(item)
    convs = []
    for item in items:
        held_out = _is_held_out(item)
        answer, rest = take(item.paragraphs)
        ask = rng.choice(ASK_TEMPLATES[item.category]).format(name=item.name)
        messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
        if rng.random() < TWO_TURN_FRACTION:
            more, _ = take(rest)
            siblings = [s for s in by_group[item.group] if s is not item and s.category != "topic"]
            if not held_out:  # a held-out item's answer must not appear in training conversations
                siblings = [s for s in siblings if not _is_held_out(s)]
            if len(more) >= MIN_ANSWER_CHARS and rng.random() < 0.5:
                messages += [
                    {"role": "user", "content": rng.choice(MORE_TEMPLATES)},
                    {"role": "assistant", "content": more},
                ]
            elif siblings:
                other = rng.choice(siblings)
                messages += [
                    {"role": "user", "content": rng.choice(SIBLING_TEMPLATES).format(name=other.name)},
                    {"role": "assistant", "content": take(other.paragraphs)[0]},
                ]
        convs.append(Conversation(item.id, item.category, messages, held_out))
    return convs


def split_conversations(convs: list[Conversation]) -> tuple[list[Conversation], list[Conversation]]:
    """Training and held-out conversations (held-out = crc32 of the item id, whole conversations)."""
    return [c for c in convs if not c.held_out], [c for c in convs if c.held_out]


# ----------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB = 4000
# Qwen-style ChatML. `enable_thinking` (Qwen3 templates take it) is accepted and ignored: no thinking.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_chat(
    messages: list[dict[str, str]], add_generation_prompt: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """ChatML text exactly as ``CHAT_TEMPLATE`` renders it, plus char spans of assistant content + end."""
    text = ""
    spans = []
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    if add_generation_prompt:
        text += "<|im_start|>assistant\n"
    return text, spans


def train_tokenizer(texts: list[str], vocab_size: int = TOKENIZER_VOCAB):
    """Byte-level BPE trained on ``texts``, wrapped as a ``PreTrainedTokenizerFast`` with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode_conversation(
    tokenizer, messages: list[dict[str, str]], max_len: int, all_tokens: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids of the ChatML conversation and labels (all tokens, or -100 outside assistant turns)."""
    text, spans = render_chat(messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if all_tokens:
        return ids[:max_len], ids[:max_len]
    labels = [
        tid if any(s <= a and b <= e for s, e in spans) else -100
        for tid, (a, b) in zip(ids, enc["offset_mapping"], strict=True)
    ]
    return ids[:max_len], labels[:max_len]


# ----------------------------------------------------------------------------- target model

MODEL_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
ROPE_THETA = 10000.0
SEQ_LEN = 256
BATCH_ROWS = 8
PEAK_LR = 3e-3
WARMUP_FRACTION = 0.04
MIN_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.1
LOSS_ON_ALL_TOKENS = True  # prompts and template too: a better language model than assistant-only
# Optimizer steps per --minutes, measured for this recipe on one thread of a 2-core AMD EPYC VM
# (about 0.36 s per step). Steps come from this constant, never from the clock: builds are reproducible.
STEPS_PER_MINUTE = 155


def make_target_config(tokenizer):
    """Qwen3 config whose vocab has spare rows past the tokenizer (the first one is DFlash's MASK)."""
    from transformers import Qwen3Config

    n = len(tokenizer)
    cfg = Qwen3Config(
        vocab_size=(n // 64 + 1) * 64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        **MODEL_SHAPE,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.rope_theta = ROPE_THETA  # also top level for readers of the transformers 4 layout (5 folds it in)
    assert cfg.vocab_size > n and cfg.vocab_size % 64 == 0
    return cfg


def _packed_rows(examples: list[tuple[list[int], list[int]]], seq_len: int, gen: torch.Generator, pad: int):
    """Endless stream of rows: conversations in a fresh random order per epoch, packed whole."""
    while True:
        ids: list[int] = []
        labels: list[int] = []
        for i in torch.randperm(len(examples), generator=gen).tolist():
            x, y = examples[i]
            if ids and len(ids) + len(x) > seq_len:
                fill = seq_len - len(ids)
                yield ids + [pad] * fill, labels + [-100] * fill
                ids, labels = [], []
            ids, labels = ids + x, labels + y
        if ids:
            fill = seq_len - len(ids)
            yield ids + [pad] * fill, labels + [-100] * fill


def lr_at(step: int, steps: int) -> float:
    """Linear warmup then cosine decay to ``MIN_LR_FRACTION`` of the peak."""
    warm = max(1, round(WARMUP_FRACTION * steps))
    if step < warm:
        return PEAK_LR * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return PEAK_LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * t)))


def train_target(
    model, examples: list[tuple[list[int], list[int]]], steps: int, seed: int, pad: int
) -> tuple[list[tuple[int, float, float]], int]:
    """AdamW + cosine on packed conversations; returns the loss curve (step, loss, seconds) and tokens seen."""
    gen = torch.Generator().manual_seed(seed)
    rows = _packed_rows(examples, SEQ_LEN, gen, pad)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    model.train()
    curve = []
    t0 = time.time()
    ema = None
    seen = 0
    for step in range(steps):
        batch = [next(rows) for _ in range(BATCH_ROWS)]
        ids = torch.tensor([b[0] for b in batch])
        labels = torch.tensor([b[1] for b in batch])
        seen += int((ids != pad).sum())
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        # Right padding under causal attention never reaches real tokens: no attention mask needed.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            dt = time.time() - t0
            curve.append((step, round(loss.item(), 4), round(dt, 1)))
            print(
                f"step {step:5d}/{steps}  loss {loss.item():.4f}  ema {ema:.4f} lr {lr_at(step, steps):.2e} {dt:.0f}s",
                flush=True,
            )
    model.eval()
    return curve, seen


# ----------------------------------------------------------------------------- regeneration

MAX_NEW_TOKENS = 160
GEN_BATCH = 64


@torch.no_grad()
def greedy_responses(model, tokenizer, chats: list[list[dict[str, str]]]) -> tuple[list[str], list[bool]]:
    """Greedy responses to each chat (ending in a user turn), batched with left padding.

    Returns the decoded texts and whether each one ended with ``<|im_end|>`` (False: hit the cap).
    """
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    encoded = [
        tokenizer(render_chat(c, add_generation_prompt=True)[0], add_special_tokens=False)["input_ids"] for c in chats
    ]
    order = sorted(range(len(chats)), key=lambda i: (len(encoded[i]), i))
    texts: list[str] = [""] * len(chats)
    finished: list[bool] = [False] * len(chats)
    t0 = time.time()
    for b in range(0, len(order), GEN_BATCH):
        idx = order[b : b + GEN_BATCH]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(encoded[i])) + encoded[i] for i in idx])
        mask = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in idx])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for row, i in enumerate(idx):
            new = out[row, width:].tolist()
            finished[i] = eos in new
            new = new[: new.index(eos)] if eos in new else [t for t in new if t != pad]
            texts[i] = tokenizer.decode(new, skip_special_tokens=True)
        print(f"  generated {min(b + GEN_BATCH, len(order))}/{len(order)}  {time.time() - t0:.0f}s", flush=True)
    return texts, finished


def regenerate(model, tokenizer, convs: list[Conversation]) -> tuple[list[Conversation], dict]:
    """Replace every assistant turn with the target's greedy response, turn by turn."""
    n_turns = max(len(c.messages) for c in convs) // 2
    current = [[dict(c.messages[0])] for c in convs]  # conversation so far, ends with a user turn
    alive = list(range(len(convs)))
    stats = {"empty_dropped": 0, "hit_max_new_tokens": 0, "turns": 0}
    for turn in range(n_turns):
        todo = [i for i in alive if len(convs[i].messages) > 2 * turn]
        if not todo:
            break
        print(f"regenerating turn {turn + 1} of {len(todo)} conversations", flush=True)
        texts, finished = greedy_responses(model, tokenizer, [current[i] for i in todo])
        for i, text, fin in zip(todo, texts, finished, strict=True):
            if not text.strip():
                stats["empty_dropped"] += 1
                if turn == 0:
                    alive.remove(i)
                else:
                    current[i] = current[i][:-1]  # drop the unanswered user turn, keep earlier turns
                continue
            stats["turns"] += 1
            stats["hit_max_new_tokens"] += int(not fin)
            current[i].append({"role": "assistant", "content": text})
            if len(convs[i].messages) > 2 * turn + 2:
                current[i].append(dict(convs[i].messages[2 * turn + 2]))
    out = []
    for i in alive:
        msgs = current[i]
        if msgs[-1]["role"] == "user":  # the next turn was never asked (cannot happen) or dropped above
            msgs = msgs[:-1]
        out.append(Conversation(convs[i].id, convs[i].category, msgs, convs[i].held_out))
    return out, stats


# ----------------------------------------------------------------------------- output


def _record(conv: Conversation, messages: list[dict[str, str]] | None = None) -> str:
    """One JSON line: id, category, messages."""
    return json.dumps(
        {"id": conv.id, "category": conv.category, "messages": messages or conv.messages}, ensure_ascii=False
    )


def _write_jsonl(path: Path, lines: list[str]) -> None:
    """Write lines as a JSONL file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _similarity(a: str, b: str) -> float:
    """difflib ratio of two strings."""
    import difflib

    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def _tree_size(folder: Path) -> list[tuple[str, int]]:
    """Relative path and byte size of every file under ``folder``."""
    return [(str(p.relative_to(folder)), p.stat().st_size) for p in sorted(folder.rglob("*")) if p.is_file()]


def _write_readme(out: Path, info: dict) -> None:
    """Write ``<out>/README.md`` describing contents, provenance, licence and how to rebuild."""
    cfg = info["config"]
    files = _tree_size(out)
    total = sum(s for _, s in files) / 1e6
    rows = "\n".join(f"| `{p}` | {s / 1e3:,.1f} KB |" for p, s in files if p != "README.md")
    every = max(1, len(info["curve"]) // 10)
    points = info["curve"][::every] + ([] if (len(info["curve"]) - 1) % every == 0 else info["curve"][-1:])
    curve = ", ".join(f"{s}: {loss:.2f}" for s, loss, _ in points)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    keys += ("intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps")
    shape = ", ".join(f"{k} {cfg[k]}" for k in keys)
    loss_on = "all tokens" if LOSS_ON_ALL_TOKENS else "assistant tokens"
    stats = info["regen_stats"]
    n_tok = info["tokenizer_len"]
    cmd = f"python tools/build_tiny.py --minutes {info['minutes']:g} --seed {info['seed']}"
    text = f"""# Tiny DFlash assets

A tiny but *trained* Qwen3 target and small chat data sets, so that the DFlash pipeline (target features, \
drafter training, speculative decoding, export) runs end to end offline on a CPU. Built by \
`tools/build_tiny.py`; do not edit by hand.

## Rebuild

```bash
{cmd}  # writes dflash_lightning/assets/tiny (--out to change)
```

Offline and deterministic for a given Python / torch version, CPU type and `--threads` (default 1): the step \
count is `round(minutes * {STEPS_PER_MINUTE})` = {info["steps"]} steps, not a clock reading. This build: Python \
{info["python"]}, torch {info["torch"]}, transformers {info["transformers"]}, tokenizers {info["tokenizers"]}, \
{info["threads"]} thread(s) on a {info["machine"]}; {info["build_seconds"] / 60:.1f} min in total \
({info["train_seconds"] / 60:.1f} min training, {info["regen_seconds"] / 60:.1f} min regeneration).

## Contents ({total:.1f} MB)

| file | size |
|---|---|
{rows}

- `target_model/`: `Qwen3ForCausalLM` (safetensors, float32), its tokenizer (byte-level BPE, {n_tok} tokens \
including `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`; Qwen-style ChatML chat template, which accepts and \
ignores `enable_thinking`; eos `<|im_end|>`, pad `<|endoftext|>`) and a greedy `generation_config.json`. \
`vocab_size` {cfg["vocab_size"]} > len(tokenizer) {n_tok}: id {n_tok} is an embedding row the tokenizer never \
emits (DFlash's MASK token).
- `data/train.jsonl` ({info["n_train"]} conversations) and `data/val.jsonl` ({info["n_val"]}): one JSON object \
per line, `{{"id": ..., "category": ..., "messages": [{{"role": ..., "content": ...}}, ...]}}` (OpenAI chat \
format; category is function, class, method or topic). Every assistant turn is the target's own greedy \
response (at most {MAX_NEW_TOKENS} new tokens, batched with left padding); two-turn conversations are \
regenerated turn by turn. {stats["empty_dropped"]} empty responses were dropped; \
{stats["hit_max_new_tokens"]} of {stats["turns"]} responses hit the token cap.
- `data/prompts.jsonl` ({info["n_prompts"]}): the held-out (val) conversations up to and including their last \
user turn, for evaluation (speculative decoding, acceptance length).

## Model

{shape}, rope_theta {ROPE_THETA:g}, tie_word_embeddings false: {info["n_params"] / 1e6:.2f}M parameters.

Trained from scratch on the training conversations in ChatML (loss on {loss_on}, packed {SEQ_LEN}-token \
rows, {BATCH_ROWS} rows per step, bf16 autocast with float32 weights, AdamW lr {PEAK_LR:g}, weight decay \
{WEIGHT_DECAY:g}, {WARMUP_FRACTION:.0%} warmup, cosine decay, {info["steps"]} steps, {info["epochs"]:.1f} \
epochs). Loss by step: {curve}.

### Why so little training

The budget is short on purpose. A target trained to memorise its small corpus (9 minutes, final loss 0.16, \
an earlier build) answers held-out prompts with fragments recalled from training answers, which no drafter \
trained for a few CPU minutes can predict: on those answers even a drafter that memorised every training \
answer (longest-suffix lookup) reached an acceptance length of only 2.14, a trigram table 1.80. Trained \
briefly, the target writes repetitive docstring-style text, as small language models do, and a drafter \
learns to predict it within CPU minutes. The embedded default therefore shows that drafter training and \
speculative decoding agree end to end; the acceptance length it reaches says nothing about a real target.

Greedy regeneration reproduces the original training answer exactly for {info["train_exact"]:.0%} of first \
turns (mean difflib similarity {info["train_sim"]:.2f}); on held-out prompts, mean similarity to the true \
documentation {info["val_sim"]:.2f}. Its answers are docstring-style and repetitive, not the documentation.

## Source and licence of the text

All text comes from the documentation that ships with CPython {info["python"]}: the language reference \
topics in `pydoc_data.topics` and the docstrings of public functions, classes and methods of {len(MODULES)} \
standard-library modules and of built-in types. It is Python documentation, Copyright Python Software \
Foundation, used under the PSF License Agreement (permissive). Questions come from a few fixed templates \
("What does `json.dumps` do?"); answers were the first prose sentences of the documentation (at most \
{ANSWER_CHARS} characters) before regeneration by the target. {info["n_items"]} conversations \
({info["n_chars"]:,} characters), {TWO_TURN_FRACTION:.0%} of them with two turns; held out: \
`crc32(id) % {HELD_OUT_MODULUS} == 0`. The tokenizer and the target were trained on the training \
conversations only.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def build(out: Path, minutes: float, seed: int, threads: int = 1, steps: int | None = None) -> None:
    """Build the tiny target and data into ``out`` (see the module docstring)."""
    old_threads, old_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        _build(Path(out), minutes, seed, threads, steps)
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_deterministic)


def _build(out: Path, minutes: float, seed: int, threads: int, steps: int | None) -> None:
    """The body of ``build`` (threads and determinism already set)."""
    import transformers
    from transformers import GenerationConfig, Qwen3ForCausalLM

    t_start = time.time()
    torch.manual_seed(seed)
    random.seed(seed)

    convs = make_conversations(seed)
    train, held = split_conversations(convs)
    n_chars = sum(len(m["content"]) for c in convs for m in c.messages)
    print(f"conversations: {len(convs)} ({len(train)} train, {len(held)} held out), {n_chars:,} characters")

    tokenizer = train_tokenizer([f"{m['role']}\n{m['content']}" for c in train for m in c.messages])
    for text in ("Explain `textwrap.dedent` in Python.", render_chat(train[0].messages)[0]):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text, "tokenizer does not round-trip"
    assert tokenizer.apply_chat_template(train[0].messages, tokenize=False) == render_chat(train[0].messages)[0]

    examples = [encode_conversation(tokenizer, c.messages, SEQ_LEN, LOSS_ON_ALL_TOKENS) for c in train]
    n_tokens = sum(len(x) for x, _ in examples)
    print(f"tokenizer: {len(tokenizer)} tokens; training tokens {n_tokens:,}")

    cfg = make_target_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    steps = steps if steps is not None else max(1, round(minutes * STEPS_PER_MINUTE))
    print(f"target: {n_params / 1e6:.2f}M parameters, vocab {cfg.vocab_size}; {steps} steps")
    t0 = time.time()
    curve, seen = train_target(model, examples, steps, seed, tokenizer.pad_token_id)
    epochs = seen / n_tokens
    train_seconds = time.time() - t0

    target_dir = out / "target_model"
    if target_dir.exists():
        shutil.rmtree(target_dir)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        do_sample=False,
        max_new_tokens=256,
    )
    model.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    # transformers 5 writes its own class name ("TokenizersBackend"), which transformers 4 cannot resolve.
    tok_cfg = target_dir / "tokenizer_config.json"
    tok_cfg.write_text(
        json.dumps({**json.loads(tok_cfg.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n"
    )

    t0 = time.time()
    regen, stats = regenerate(model, tokenizer, train + held)
    regen_seconds = time.time() - t0
    orig = {c.id: c for c in convs}
    r_train = [c for c in regen if not c.held_out]
    r_val = [c for c in regen if c.held_out]
    exact = [c.messages[1]["content"] == orig[c.id].messages[1]["content"] for c in r_train]
    train_sim = sum(_similarity(c.messages[1]["content"], orig[c.id].messages[1]["content"]) for c in r_train)
    val_sim = sum(_similarity(c.messages[1]["content"], orig[c.id].messages[1]["content"]) for c in r_val)
    train_sim /= max(1, len(r_train))
    val_sim /= max(1, len(r_val))
    print(
        f"regenerated: {len(r_train)} train, {len(r_val)} val; stats {stats}; train exact first turn "
        f"{sum(exact) / max(1, len(exact)):.1%}, similarity train {train_sim:.3f} val {val_sim:.3f}"
    )

    data_dir = out / "data"
    _write_jsonl(data_dir / "train.jsonl", [_record(c) for c in r_train])
    _write_jsonl(data_dir / "val.jsonl", [_record(c) for c in r_val])
    prompts = []
    for c in r_val:
        last_user = max(i for i, m in enumerate(c.messages) if m["role"] == "user")
        prompts.append(_record(c, c.messages[: last_user + 1]))
    _write_jsonl(data_dir / "prompts.jsonl", prompts)
    print(f"wrote {len(r_train)} train, {len(r_val)} val, {len(prompts)} prompts to {data_dir}")

    import tokenizers

    info = {
        "config": cfg.to_dict(),
        "minutes": minutes,
        "seed": seed,
        "threads": threads,
        "steps": steps,
        "python": platform.python_version(),
        "machine": f"{os.cpu_count()}-core {platform.machine()} machine",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "tokenizer_len": len(tokenizer),
        "n_params": n_params,
        "epochs": epochs,
        "curve": curve,
        "n_train": len(r_train),
        "n_val": len(r_val),
        "n_prompts": len(prompts),
        "regen_stats": stats,
        "train_exact": sum(exact) / max(1, len(exact)),
        "train_sim": train_sim,
        "val_sim": val_sim,
        "n_items": len(convs),
        "n_chars": n_chars,
        "train_seconds": train_seconds,
        "regen_seconds": regen_seconds,
        "build_seconds": time.time() - t_start,
    }
    _write_readme(out, info)
    total = sum(s for _, s in _tree_size(out))
    print(f"done in {(time.time() - t_start) / 60:.1f} min; {out} holds {total / 1e6:.2f} MB")


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument(
        "--minutes",
        type=float,
        default=2.0,  # short on purpose: see the "Why so little training" section of the generated README
        help=f"training budget; sets the step count to round(minutes * {STEPS_PER_MINUTE})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (results depend on it)")
    parser.add_argument("--steps", type=int, default=None, help="override the step count")
    args = parser.parse_args(argv)
    build(args.out, args.minutes, args.seed, threads=args.threads, steps=args.steps)


if __name__ == "__main__":
    sys.exit(main())
