"""Python's own documentation as text: the language reference topics (`pydoc_data.topics`) and the docstrings of
modules, split into prose sentences; shared by the prompt builder and tools/build_tiny.py (the tiny set's source).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_lightning.regenerate.prompts.records import Prompt, user_prompt

# Standard-library modules whose public functions / classes / methods are documented in the corpus.
MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "base64", "binascii", "bisect", "builtins", "calendar", "cmath",
    "collections", "colorsys", "concurrent.futures", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "functools",
    "getpass", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "io",
    "ipaddress", "itertools", "json", "keyword", "linecache", "math", "mimetypes", "numbers",
    "operator", "os", "os.path", "pathlib", "pickle", "platform", "pprint", "queue", "random", "re",
    "reprlib", "sched", "secrets", "shlex", "shutil", "statistics", "string", "struct", "subprocess",
    "sys", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "types",
    "unicodedata", "urllib.parse", "uuid", "warnings", "weakref", "xml.etree.ElementTree", "zlib",
)  # fmt: skip
# Built-in types whose public methods are documented too (their own methods only).
BUILTIN_TYPES: tuple[str, ...] = (
    "bytes", "dict", "float", "int", "list", "set", "str", "tuple",
)  # fmt: skip

ANSWER_CHARS = 320  # assistant turns are cut at a sentence end at or before this many characters
MIN_ANSWER_CHARS = 30

ASK_TEMPLATES: dict[str, tuple[str, ...]] = {
    "function": (
        "What does `{name}` do?",
        "Explain `{name}` in Python.",
        "What is `{name}` used for?",
        "Can you describe the `{name}` function?",
        "How does `{name}` work?",
        "Tell me about `{name}`.",
        "In Python, what does `{name}` do?",
    ),
    "class": (
        "What is `{name}`?",
        "Explain the `{name}` class in Python.",
        "What is the `{name}` class used for?",
        "Can you describe `{name}`?",
        "Tell me about the `{name}` class.",
    ),
    "method": (
        "What does `{name}` do?",
        "Explain the `{name}` method.",
        "What is `{name}` used for?",
        "How does `{name}` work in Python?",
        "Tell me about `{name}`.",
    ),
    "topic": (
        "Describe {name}.",
        "Explain {name} in Python.",
        "What should I know about {name} in Python?",
        "Tell me about {name}.",
        "Can you explain {name}?",
    ),
}
MORE_TEMPLATES = ("Can you tell me more?", "Tell me more.", "What else should I know?", "Go on, please.")
SIBLING_TEMPLATES = ("And what about `{name}`?", "What about `{name}`?", "How about `{name}`?")

_SIGNATURE = re.compile(r"^[\w.\[\]]+\(.*\)(\s*->.*)?$")
_UNDERLINE = re.compile(r"^([*=\-~^\"])\1{2,}$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`\"'(])")
_NO_BREAK_AFTER = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "Ex.", "No.")


@dataclass
class Item:
    """One documented thing: its id, display name, category and prose sentences per paragraph."""

    id: str
    name: str
    category: str
    paragraphs: list[list[str]]
    group: str = ""  # items of one group (module / class / topic) are offered as follow-ups
    obj: object = field(default=None, repr=False)  # the documented function or class; None for a reference topic



def clean(text: str) -> str:
    """Join wrapped lines, collapse whitespace, turn reST ``literals`` into `markdown`."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r"(\w)-\n\s*(\w)", r"\1-\2", text)  # words hyphenated across a line break
    return re.sub(r"\s+", " ", text).strip()


def sentences(paragraph: str) -> list[str]:
    """Split a paragraph into sentences, not breaking after common abbreviations."""
    out: list[str] = []
    for piece in _SENTENCE_END.split(paragraph):
        if out and out[-1].endswith(_NO_BREAK_AFTER):
            out[-1] = out[-1] + " " + piece
        else:
            out.append(piece)
    return [s for s in out if s]


def prose(doc: str) -> list[list[str]]:
    """Prose paragraphs of a docstring / reference text as sentence lists; code and lists skipped."""
    paragraphs: list[list[str]] = []
    blocks = re.split(r"\n\s*\n", doc.strip("\n"))
    for i, block in enumerate(blocks):
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines:
            continue
        if lines[0].startswith((" ", "\t")) or any(">>>" in ln or "::=" in ln for ln in lines):
            continue  # indented block: grammar, code, parameter list
        if i == 0 and all(_SIGNATURE.match(ln.strip()) or "->" in ln for ln in lines):
            continue  # "int(x, base=10) -> integer" signature lines of C docstrings
        if lines[0].lstrip().startswith(("*", "-", "+", "|", "Note:", "Warning:", "See also")):
            continue
        text = clean("\n".join(lines))
        if len(text) < 2 or not text[0].isalnum() and text[0] not in "`\"'(":
            continue
        if text.endswith(":"):  # introduces a list / code block that is skipped
            if len(text) < 80:
                continue
            text = text[:-1].rstrip() + "."
        if not text.endswith((".", "!", "?", ")")):
            continue
        paragraphs.append(sentences(text))
    return paragraphs


def take(paragraphs: list[list[str]], limit: int = ANSWER_CHARS) -> tuple[str, list[list[str]]]:
    """Take whole leading sentences up to ``limit`` characters; return the text and what remains."""
    parts: list[str] = []
    size = 0
    rest = [list(p) for p in paragraphs]
    while rest:
        para = rest[0]
        taken: list[str] = []
        while para:
            extra = len(para[0]) + (1 if taken else (2 if parts else 0))
            if size + extra > limit:
                break
            size += extra
            taken.append(para.pop(0))
        if taken:
            parts.append(" ".join(taken))
        if para:  # sentence did not fit: stop here
            break
        rest.pop(0)
    return "\n\n".join(parts), [p for p in rest if p]


def topic_name(title: str) -> str:
    """'The "for" statement' -> 'the `for` statement'; 'Mapping Types' -> 'mapping types'."""
    words = re.sub(r'"([^"]+)"', r"`\1`", title).split(" ")
    keep = {"Python", "Unicode"}
    return " ".join(w.lower() if w[:1].isupper() and w[1:].islower() and w not in keep else w for w in words)


def topic_items() -> list[Item]:
    """Sections of the language reference (``pydoc_data.topics``) and the objects they define."""
    from pydoc_data.topics import topics

    items: list[Item] = []
    for key in sorted(topics):
        lines = topics[key].split("\n")
        heads = [i for i in range(len(lines) - 1) if lines[i].strip() and _UNDERLINE.match(lines[i + 1].strip())]
        heads.append(len(lines))
        for h, nxt in zip(heads[:-1], heads[1:], strict=True):
            title = lines[h].strip()
            body = lines[h + 2 : nxt]
            paragraphs = prose("\n".join(body))
            if paragraphs:
                name = topic_name(title)
                items.append(Item(f"topic:{key}:{title}", name, "topic", paragraphs, group=f"topic:{key}"))
            # definition entries: an unindented "name(args)" line followed by an indented description
            for j in range(len(body) - 2):
                line = body[j]
                m = re.match(r"^([A-Za-z_]\w*\.\w+)\(", line)
                if not m or body[j + 1].strip() or not body[j + 2].startswith("   "):
                    continue
                desc: list[str] = []
                for ln in body[j + 2 :]:
                    if ln.strip() and not ln.startswith("   "):
                        break
                    desc.append(ln[3:])
                paragraphs = prose("\n".join(desc))
                if paragraphs:
                    items.append(Item(f"ref:{m.group(1)}", m.group(1), "method", paragraphs, group=f"topic:{key}"))
    return items


def own_doc(obj: object) -> str | None:
    """The object's own docstring (not inherited), cleaned of indentation."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def method_items(cls: type, qual: str) -> list[Item]:
    """Items for the public methods a class defines itself."""
    items = []
    for name in sorted(vars(cls)):
        if name.startswith("_"):
            continue
        attr = vars(cls)[name]
        func = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        if not callable(func) or isinstance(func, type):
            continue
        doc = own_doc(func)
        if doc:
            items.append(Item(f"method:{qual}.{name}", f"{qual}.{name}", "method", prose(doc), qual, func))
    return items


def module_items(modules: Sequence[str] = MODULES, submodules: bool = False) -> list[Item]:
    """Public functions, classes and their methods of `modules`; `submodules`: also what a module re-exports from
    its own submodules (a package's API: `sympy.solve` is defined in `sympy.solvers.solvers`)."""
    items: list[Item] = []
    for mod_name in modules:
        mod = importlib.import_module(mod_name)
        homes = {mod.__name__, "_" + mod.__name__, mod_name} | ({"posix", "nt"} if mod_name == "os" else set())
        prefix = "" if mod_name == "builtins" else mod_name + "."
        for name in sorted(vars(mod)):
            if name.startswith("_"):
                continue
            obj = vars(mod)[name]
            home = getattr(obj, "__module__", None)
            if home not in homes and not (submodules and isinstance(home, str) and home.startswith(mod_name + ".")):
                continue
            if isinstance(obj, type):
                if issubclass(obj, BaseException) and mod_name == "builtins":
                    continue  # dozens of near-identical exception docstrings
                doc = own_doc(obj)
                if doc:
                    items.append(Item(f"class:{prefix}{name}", prefix + name, "class", prose(doc), mod_name, obj))
                if mod_name != "builtins" or name in BUILTIN_TYPES:
                    items.extend(method_items(obj, prefix + name))
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                doc = own_doc(obj)
                if doc:
                    items.append(
                        Item(f"function:{prefix}{name}", prefix + name, "function", prose(doc), mod_name, obj)
                    )
    return items


def collect_items() -> list[Item]:
    """All documented items with a usable first answer, deduplicated by name and by answer text."""
    items = topic_items() + module_items()
    seen_names: set[str] = set()
    seen_answers: set[str] = set()
    kept = []
    for item in items:
        answer, _ = take(item.paragraphs)
        if len(answer) < MIN_ANSWER_CHARS or item.name in seen_names or answer in seen_answers:
            continue
        seen_names.add(item.name)
        seen_answers.add(answer)
        kept.append(item)
    return kept


# ------------------------------------------------------------------------------- the prompt builder's source

CATEGORY = "python_docs"
MORE_ASKS: dict[str, tuple[str, ...]] = {
    "topic": (
        "Give me an example of {name} in Python.",
        "What are common mistakes people make with {name} in Python?",
        "How would you explain {name} to a beginner?",
        "Summarize {name} in Python in three bullet points.",
        "When should I care about {name} when writing Python?",
        "Write a short code example that demonstrates {name}.",
        "What changed about {name} across Python versions?",
        "Quiz me on {name}: ask three questions and give the answers.",
        "How do {name} in Python compare with other languages?",
        "What does the language reference say about {name}? Keep it short.",
    ),
    "method": (
        "When does Python call `{name}`?",
        "Show me a class that implements `{name}`.",
        "Give an example of `{name}` in use.",
        "What should `{name}` return?",
        "What goes wrong if `{name}` is implemented incorrectly?",
        "Write a minimal example that overrides `{name}`.",
        "Why would I define `{name}` on my own class?",
    ),
}
ASKS_PER_ITEM = 8
QUOTE_ASKS = (
    'The Python language reference says: "{s}" What does this mean? Explain with an example.',
    'Explain this sentence from the Python docs in plain words: "{s}"',
    'I read in the Python documentation: "{s}" Can you show code that illustrates it?',
    'Is this true in Python, and why? "{s}"',
    'Rewrite this for a beginner and add a small example: "{s}"',
)
QUOTE_CHARS = (60, 300)


def prompts(rng: random.Random) -> list[Prompt]:
    """Questions about the language reference's topics and the special methods it defines (`topic_items`), and about
    single sentences of it; the documentation's first sentences are the reference answer of the questions."""
    out: list[Prompt] = []
    for item in topic_items():
        answer = take(item.paragraphs)[0] or None
        asks = ASK_TEMPLATES[item.category] + MORE_ASKS[item.category]
        for k, ask in enumerate(rng.sample(asks, min(ASKS_PER_ITEM, len(asks)))):
            out.append(user_prompt(f"{CATEGORY}:{item.id}:{k}", CATEGORY, ask.format(name=item.name), answer))
        quotes = [s for p in item.paragraphs for s in p if QUOTE_CHARS[0] <= len(s) <= QUOTE_CHARS[1]]
        for k, sentence in enumerate(quotes):
            ask = rng.choice(QUOTE_ASKS).format(s=sentence.replace('"', "'"))
            out.append(user_prompt(f"{CATEGORY}:{item.id}:quote{k}", CATEGORY, ask))
    rng.shuffle(out)
    return out
