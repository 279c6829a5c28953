"""Prompts the target writes itself: asked, for each seed topic, to write a question or a request a user might send,
sampled from the in-process Hugging Face model in batches (`generate`), then cleaned and filtered. The kept prompts
go to a file of their own (committed, since sampling depends on the machine), which the builder reads as a source.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_lightning.regenerate.prompts.records import Prompt, read_jsonl_gz, user_prompt, write_jsonl_gz

CATEGORY = "self_written"
TOPICS = (
    "baking bread", "black holes", "budgeting for a first apartment", "caring for a houseplant", "chess openings",
    "climate change", "cooking rice", "CSS flexbox", "data visualization", "dinosaurs", "email etiquette",
    "exercise for beginners", "Git branches", "gardening tomatoes", "healthy breakfast ideas", "how vaccines work",
    "HTML forms", "interview preparation", "JavaScript promises", "job cover letters", "learning a new language",
    "linear algebra", "machine learning basics", "making coffee", "meditation", "microwaves", "moving to a new city",
    "music theory", "neural networks", "ocean tides", "photosynthesis", "planning a birthday party", "prime numbers",
    "probability", "public speaking", "Python lists", "Python dictionaries", "Python decorators", "Python classes",
    "reading more books", "recycling", "regular expressions", "renewable energy", "resume writing", "road trips",
    "saving money", "sleep habits", "solar panels", "SQL joins", "statistics", "studying for exams",
    "the French Revolution", "the human heart", "the Moon landing", "the Roman Empire", "the water cycle",
    "time management", "training a puppy", "traveling to Japan", "unit testing", "volcanoes", "web accessibility",
    "writing a short story", "writing poetry", "yoga", "the stock market", "electric cars", "bicycles", "rainbows",
    "earthquakes", "the immune system", "sorting algorithms", "binary numbers", "the internet", "passwords",
    "spreadsheets", "fractions", "geometry", "the solar system", "ancient Egypt", "climate zones", "bees",
    "friendship", "negotiating a salary", "starting a small business", "podcasts", "photography", "painting",
    "knitting", "camping", "first aid", "nutrition labels", "tea", "chocolate", "cheese making", "fermentation",
    "the printing press", "electricity at home", "magnets", "sound waves", "light and color", "weather forecasts",
    "shell scripting", "Docker containers", "REST APIs", "recursion", "hash tables", "Linux file permissions",
    "debugging code", "code reviews", "open source licenses", "cloud storage", "keyboard shortcuts", "note taking",
    "remote work", "team meetings", "writing emails to a professor", "learning to swim", "running a marathon",
    "board games", "video game design", "origami", "bird watching", "stargazing", "composting", "minimalism",
)  # fmt: skip
ASKS = (
    "Write five different questions that people might ask about {topic}. Number them 1 to 5.",
    "Write five different requests a beginner might send to an AI assistant about {topic}. Number them 1 to 5.",
)
SAMPLES = 1  # per topic and ask; each answer lists up to five prompts
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_new_tokens": 96}
LENGTH = (20, 300)  # characters a kept prompt has
_ITEM = re.compile(r"^\s*\d+[.)]\s+(.*)$")
_LABEL = re.compile(r"^(question|request|instruction|user|prompt)\s*\d*\s*:\s*", re.I)


def clean(answer: str) -> list[tuple[str | None, str]]:
    """(each numbered line's prompt, or None; why it was dropped, or "kept") of a generated list; the last line of
    an answer cut at max_new_tokens is dropped."""
    lines = answer.strip().split("\n")
    out: list[tuple[str | None, str]] = []
    for k, line in enumerate(lines):
        item = _ITEM.match(line)
        if item is None:
            continue
        text = _LABEL.sub("", item.group(1)).strip().strip('"*').strip()
        if k == len(lines) - 1 and not text.endswith(("?", ".", "!")):
            out.append((None, "cut off"))
        elif not LENGTH[0] <= len(text) <= LENGTH[1] or len(text.split()) < 4:
            out.append((None, "too short or too long"))
        elif not text.endswith(("?", ".", "!")) or not text[0].isalpha():
            out.append((None, "not a sentence"))
        else:
            out.append((text, "kept"))
    return out or [(None, "no numbered line")]


def write(target: str | Path, out: Path, seed: int = 0, batch_size: int = 48, topics: int | None = None,
          threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Sample the target's prompts for every topic and ask (the first `topics` topics if given) into `out` (gzip
    JSONL: id, topic, ask, text) and `out`'s `.json` summary beside it; returns the summary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_lightning.target_model import resolve_model_dir

    if threads:
        torch.set_num_threads(threads)
    folder = resolve_model_dir(str(target))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    jobs = [(t, a, s) for t in range(len(TOPICS[:topics])) for a in range(len(ASKS)) for s in range(SAMPLES)]
    began, cpu, reasons, kept, tokens = time.monotonic(), time.process_time(), Counter(), [], 0
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start : start + batch_size]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": ASKS[a].format(topic=TOPICS[t])}],
                                               tokenize=False, add_generation_prompt=True) for t, a, _ in batch]
        encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(device)
        torch.manual_seed(seed + start)  # each batch samples the same on a rerun, also a partial one
        with torch.no_grad():
            out_ids = model.generate(**encoded, **SAMPLING, pad_token_id=tokenizer.pad_token_id)
        new = out_ids[:, encoded["input_ids"].shape[1] :]
        tokens += int((new != tokenizer.pad_token_id).sum())
        for (t, a, s), row in zip(batch, tokenizer.batch_decode(new, skip_special_tokens=True), strict=True):
            for k, (text, why) in enumerate(clean(row)):
                reasons[why] += 1
                if text is not None:
                    kept.append({"id": f"{CATEGORY}:{t}:{a}:{s}:{k}", "topic": TOPICS[t], "ask": a, "text": text})
        print(f"self-written: {start + len(batch)}/{len(jobs)} sampled, {len(kept)} kept, "
              f"{time.monotonic() - began:.0f} s", flush=True)
    write_jsonl_gz(out, kept)
    summary = {"target": str(folder), "device": device, "seed": seed, "batch_size": batch_size, "sampling": SAMPLING,
               "torch_threads": torch.get_num_threads(), "sampled": len(jobs), "tokens": tokens,
               "outcomes": dict(sorted(reasons.items())), "seconds": round(time.monotonic() - began, 1),
               "cpu_seconds": round(time.process_time() - cpu, 1)}
    out.with_suffix("").with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def prompts(path: Path) -> list[Prompt]:
    """The kept prompts of a file `write` made, as records."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no self-written prompts here; make them with `python -m dflash_lightning."
                                "regenerate.prompts self-written`, or leave self_written out of --counts")
    out = []
    for number, row in enumerate(read_jsonl_gz(path), 1):
        if not isinstance(row.get("id"), str) or not isinstance(row.get("text"), str):
            raise ValueError(f"{path}:{number}: a self-written prompt needs string 'id' and 'text'")
        out.append(user_prompt(row["id"], CATEGORY, row["text"]))
    return out
