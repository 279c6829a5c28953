"""Tiny stand-in targets built in the test session: a Qwen3 model and a ChatML tokenizer, offline."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

WORDS = (
    "the a of to and in is it that for on with as was by this be are or an at from which but not have "
    "what does do explain python function returns value list string number file object class module"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(folder: Path):
    """A word-level ChatML tokenizer over a small vocabulary, saved to `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS + ["\n", "user", "assistant", "system", "?", ".", ","])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_target(folder: Path, layers: int = 6, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                vocab_extra: int = 8, seed: int = 0, **overrides) -> Path:
    """A random tiny Qwen3 causal LM plus tokenizer in `folder` (vocab has spare rows for MASK)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = make_tokenizer(folder)
    config = Qwen3Config(
        vocab_size=len(tok) + vocab_extra, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, **overrides,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def fine_tune(src: Path, dst: Path, weight: str = "model.layers.1.self_attn.q_proj.weight") -> Path:
    """A copy of a target folder with one weight moved a little: the same config and shapes, other content."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (file,) = dst.glob("*.safetensors")
    state = load_file(file)
    state[weight] = state[weight] + 1e-3
    save_file(state, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One thread: the models here are tiny, and on a shared 2-core machine extra threads wait on each other."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """Path of a session-wide tiny random Qwen3 target."""
    return make_target(tmp_path_factory.mktemp("target"))


# ------------------------------------------------------------------------------- the version sets' subset
# CI's minimum and newest parts run `pytest -m "not pinned_only"` (docs/versions.md, "Which tests run on which
# set"). A test may be marked pinned_only for one of three reasons, named in the mark and checked here:
#   pinned_only("reference"): it holds our own arithmetic or logic against a reference written in the test,
#       calling libraries for tensor operations in eager mode only;
#   pinned_only("tool"): it runs a script of benchmarks/ or tools/, which we run on the pinned set ourselves;
#   pinned_only(same_path_as="tests/test_x.py::test_y[param]"): it repeats, under a setting only our own code
#       reads or a fault our own code handles, the calls into the libraries of the named test, which runs on
#       every set.
PINNED_ONLY_REASONS = ("reference", "tool")
VERSIONS_DOC = Path(__file__).parents[1] / "docs" / "versions.md"
QUOTED_COUNT = re.compile(r"lists the marked\s+tests: (\d+) ")
"""Where docs/versions.md quotes how many tests are pinned_only: checked against the count whenever the whole suite
is collected."""


def check_quoted_count(text: str, marked: int, source: str = "docs/versions.md") -> None:
    """Refuse a doc whose quoted pinned_only count is not the `marked` tests collected."""
    quoted = QUOTED_COUNT.search(text)
    if quoted is None:
        raise pytest.UsageError(f"{source}: no 'lists the marked tests: N' sentence to check the pinned_only count by")
    if int(quoted[1]) != marked:
        raise pytest.UsageError(f"{source} says {quoted[1]} tests are pinned_only; the suite collects {marked}: "
                                "write that count there")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects any
def pytest_collection_modifyitems(config, items):
    """Refuse a pinned_only mark without one of its reasons; on the whole suite, also one naming a test that is not
    collected or is pinned_only itself, and a pinned_only count in docs/versions.md other than the collected one."""
    whole = config.args_source is pytest.Config.ArgsSource.TESTPATHS
    if whole:
        check_quoted_count(VERSIONS_DOC.read_text(), sum(item.get_closest_marker("pinned_only") is not None
                                                         for item in items))
    by_id = {item.nodeid: item for item in items}
    for item in items:
        for mark in item.iter_markers("pinned_only"):  # a parametrized test may carry one per parameter
            args, kwargs = mark.args, mark.kwargs
            if not ((len(args) == 1 and args[0] in PINNED_ONLY_REASONS and not kwargs)
                    or (not args and list(kwargs) == ["same_path_as"])):
                raise pytest.UsageError(f"{item.nodeid}: pinned_only takes one of {PINNED_ONLY_REASONS} or "
                                        f"same_path_as=<a test's id>, not {args} {kwargs}")
            like = kwargs.get("same_path_as")
            if like is not None and whole:
                other = by_id.get(like)
                if other is None or other.get_closest_marker("pinned_only") is not None:
                    raise pytest.UsageError(f"{item.nodeid}: pinned_only(same_path_as={like!r}) names a test that "
                                            f"is {'not collected' if other is None else 'pinned_only itself'}")
