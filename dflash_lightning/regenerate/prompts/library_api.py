"""The installed libraries' own documentation as prompts: for each public function, class and method of the standard
library and of the pure-Python API of installed packages, "explain X", "how do I use X" and "fix this call to X" with a
small generated bug (a misspelled keyword or name, a missing or extra argument), from its docstring and signature.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import sys
from collections.abc import Sequence

from dflash_lightning.regenerate.prompts.python_docs import (
    ASK_TEMPLATES,
    MIN_ANSWER_CHARS,
    MODULES,
    Item,
    module_items,
    take,
)
from dflash_lightning.regenerate.prompts.records import Prompt, user_prompt

CATEGORY = "library_api"
# Standard-library modules left out: they open windows or browsers, print on import, or are platform shims.
STDLIB_SKIP = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
    "msilib", "winreg", "winsound", "nt", "msvcrt", "test", "xxlimited", "xxsubtype", "pydoc", "sre_compile",
    "sre_constants", "sre_parse", "nturl2path", "ntpath", "posixpath", "opcode", "token", "curses",
    "readline", "rlcompleter", "site", "sitecustomize", "usercustomize",
})  # fmt: skip
# Submodules of the standard library with an API of their own (`sys.stdlib_module_names` lists packages only).
STDLIB_SUBMODULES = (
    "os.path", "concurrent.futures", "email.utils", "email.message", "xml.etree.ElementTree", "xml.dom.minidom",
    "urllib.parse", "urllib.request", "http.client", "http.server", "http.cookies", "json.decoder",
    "importlib.metadata", "importlib.resources", "logging.handlers", "multiprocessing.pool", "unittest.mock",
    "collections.abc", "sqlite3.dbapi2", "asyncio.tasks", "asyncio.queues", "asyncio.streams", "dbm.dumb",
)  # fmt: skip
# Installed packages whose public API is read, with what they re-export from their own submodules.
PACKAGES = (
    "torch", "torch.nn", "torch.nn.functional", "torch.optim", "torch.optim.lr_scheduler", "torch.utils.data",
    "torch.linalg", "torch.fft", "torch.distributions", "torch.autograd", "torch.special", "numpy", "numpy.linalg",
    "numpy.random", "numpy.fft", "numpy.polynomial", "numpy.ma", "sympy", "networkx", "mpmath", "lightning.pytorch",
    "lightning.pytorch.callbacks", "torchmetrics", "jsonargparse", "rich.console", "rich.progress", "rich.table",
    "rich.text", "pyarrow", "pyarrow.parquet", "pyarrow.compute", "matplotlib.pyplot", "jinja2", "safetensors.torch",
    "tokenizers", "fsspec", "filelock", "yaml", "tqdm", "fire", "termcolor", "markupsafe", "packaging.version",
)  # fmt: skip
ITEMS_PER_MODULE = 150  # at most, chosen at random: sympy alone defines thousands of methods
SIGNATURE_CHARS = 160
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")

EXPLAIN_ASKS = (
    "Here is the docstring of `{name}`:\n\n{doc}\n\nExplain it in plain words.",
    "What do the parameters of `{name}{sig}` mean?",
    "Summarize what `{name}` does in two sentences.",
    "What does `{name}` return, and when would I use it?",
    "The documentation of `{name}` says: \"{doc}\" Can you explain that with an example?",
)
USE_ASKS = (
    "How do I use `{name}`? Show a short example.",
    "Show me how to call `{name}{sig}` with an example.",
    "Write a small program that uses `{name}`.",
    "What is a typical use case for `{name}`? Include code.",
    "Give me two examples of `{name}` in action.",
    "How do I use `{name}` correctly, and what mistakes should I avoid?",
)
FIX_ASKS = (
    "This call to `{name}` fails:\n\n```python\n{bad}\n```\n\nWhat is wrong, and how do I fix it?",
    "Fix this line of Python:\n\n```python\n{bad}\n```",
    "Why does `{bad}` raise an error? The signature is `{name}{sig}`.",
    "My code `{bad}` doesn't work. What's the bug?",
    "I get an error from this call:\n\n```python\n{bad}\n```\n\nHow should it be written?",
)


def stdlib_modules() -> list[str]:
    """The standard library's public top-level modules (this Python's list) and the submodules named above."""
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in STDLIB_SKIP)
    return [*MODULES, *(n for n in names + list(STDLIB_SUBMODULES) if n not in MODULES)]


def importable(modules: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the modules that import here, those that do not): what is read depends on what is installed."""
    found, missing = [], []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # any failure at import (missing, a platform module, a broken install) leaves it out
            missing.append(name)
        else:
            found.append(name)
    return found, missing


def signature(item: Item) -> inspect.Signature | None:
    """The item's signature without `self` / `cls` (None where it has none or it is too long to quote)."""
    try:
        sig = inspect.signature(item.obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if item.category == "method" and params and params[0].name in ("self", "cls"):
        sig = sig.replace(parameters=params[1:])
    return sig if len(str(sig)) <= SIGNATURE_CHARS else None


def _callee(item: Item) -> str:
    """What a call writes before the parentheses: `json.dumps`, or `path.read_text` for a method of `Path`."""
    if item.category != "method":
        return item.name
    owner, _, method = item.name.rpartition(".")
    var = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", owner.rpartition(".")[2]).lower()  # IMAP4 -> imap4
    return f"{var}.{method}"


def _typo(word: str, rng: random.Random) -> str:
    """The word with two neighbouring different letters swapped, else its last letter doubled."""
    spots = [i for i in range(len(word) - 1) if word[i] != word[i + 1] and word[i : i + 2].isalpha()]
    if not spots:
        return word + word[-1]
    i = rng.choice(spots)
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


def _literal(value: object) -> str | None:
    """A keyword argument's value: its default changed (a bool, a number) or kept (a short string), else None."""
    if isinstance(value, bool):
        return repr(not value)
    if isinstance(value, int):
        return repr(value + 1)
    if isinstance(value, float):
        return repr(value * 2)
    if isinstance(value, str) and 0 < len(value) < 20:
        return repr(value)
    return None


def bugged_call(item: Item, sig: inspect.Signature, rng: random.Random) -> tuple[str, str, str] | None:
    """(a call with one bug, the call without it, what the bug is), or None where no bug fits the signature."""
    P = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in params if p.name in positional and p.default is P.empty]
    keywords = [p for p in params if p.default is not P.empty and p.kind != P.POSITIONAL_ONLY]
    optional = [(p.name, _literal(p.default)) for p in keywords]
    optional = [(n, v) for n, v in optional if v is not None]
    var_args = any(p.kind == P.VAR_POSITIONAL for p in params)
    var_kwargs = any(p.kind == P.VAR_KEYWORD for p in params)
    kw_only = [p.name for p in params if p.kind == P.KEYWORD_ONLY and p.default is P.empty]
    callee = _callee(item)
    keyword = rng.choice(optional) if optional else None
    args = required + [f"{n}={n}" for n in kw_only] + ([f"{keyword[0]}={keyword[1]}"] if keyword else [])
    good = f"{callee}({', '.join(args)})"
    bugs = ["name"]
    if keyword and not var_kwargs:
        bugs.append("keyword")
    if required and not var_args:
        bugs.append("missing")
    if not var_args and not any(p.kind == P.KEYWORD_ONLY for p in params) and len(required) < 3:
        bugs.append("extra")
    bug = rng.choice(bugs)
    if bug == "keyword":
        wrong = _typo(keyword[0], rng)
        bad = good.replace(f"{keyword[0]}={keyword[1]}", f"{wrong}={keyword[1]}")
        what = f"`{wrong}` is not a parameter of `{item.name}`; the keyword is `{keyword[0]}`"
    elif bug == "missing":
        bad = f"{callee}({', '.join(args[1:])})"
        what = f"the required argument `{required[0]}` is missing"
    elif bug == "extra":
        bad = f"{callee}({', '.join(required + ['extra'] + args[len(required):])})"
        if len(positional) > len(required):
            return None  # the extra value would fill an optional parameter: no error to find
        what = f"`{item.name}` takes {len(required)} positional argument(s); `extra` is one too many"
    else:
        head, _, last = callee.rpartition(".")
        wrong = _typo(last, rng)
        bad = f"{head + '.' if head else ''}{wrong}({', '.join(args)})"
        what = f"the name is misspelled: `{wrong}` should be `{last}`"
    return (bad, good, what) if bad != good else None


def item_prompts(item: Item, rng: random.Random) -> list[Prompt]:
    """Up to three prompts about one item: explain it, use it, fix a call to it."""
    sig = signature(item)
    shown = _ADDRESS.sub(">", str(sig)) if sig is not None else "(...)"  # <function copy2 at 0x7f..>: no address
    doc = take(item.paragraphs, 240)[0]
    doc = doc if len(doc) >= MIN_ANSWER_CHARS else ""  # "An enumeration." says nothing to explain
    explain = [a for a in EXPLAIN_ASKS if doc or "{doc}" not in a]
    out = [user_prompt(f"{CATEGORY}:{item.id}:explain", CATEGORY,
                       rng.choice(ASK_TEMPLATES[item.category] + tuple(explain)).format(name=item.name, sig=shown,
                                                                                         doc=doc), doc or None),
           user_prompt(f"{CATEGORY}:{item.id}:use", CATEGORY, rng.choice(USE_ASKS).format(name=item.name, sig=shown))]
    fix = bugged_call(item, sig, rng) if sig is not None else None
    if fix is not None:
        bad, good, what = fix
        ask = rng.choice(FIX_ASKS).format(name=item.name, sig=shown, bad=bad)
        out.append(user_prompt(f"{CATEGORY}:{item.id}:fix", CATEGORY, ask, f"{what[0].upper()}{what[1:]}. "
                               f"The correct call is `{good}`."))
    return out


def prompts(rng: random.Random, modules: Sequence[str], items_per_module: int = ITEMS_PER_MODULE) -> list[Prompt]:
    """Prompts about the documented items of `modules` (stdlib ones as read, packages with their re-exports), at
    most `items_per_module` items of each, each name once."""
    seen: set[str] = set()
    out: list[Prompt] = []
    for module in modules:
        items = [i for i in module_items([module], submodules=module.split(".")[0] not in sys.stdlib_module_names)
                 if i.name not in seen and i.paragraphs]
        items = sorted(rng.sample(items, min(items_per_module, len(items))), key=lambda i: i.id)
        for item in items:
            seen.add(item.name)
            out.extend(item_prompts(item, rng))
    rng.shuffle(out)
    return out
