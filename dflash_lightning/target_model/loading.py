"""Loading the frozen target: its folder, config, tokenizer ids, embedding and head, and weight index.

Everything here reads the target's files; nothing runs it (feature extraction is in `features.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(path: str, setting: str = "target.path") -> Path:
    """A local model folder as is, or a hub id resolved through the local Hugging Face cache (downloaded if absent);
    a model that cannot be found is one `FileNotFoundError` line naming it, the `setting` and what to do."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise FileNotFoundError(f"{setting}: no model folder at '{path}' (nor a hub id, 'org/name'): set {setting} "
                                "to a local Hugging Face model folder or a hub id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except GatedRepoError as err:
        why, todo = "the hub refuses it (a gated model: accept its licence on its hub page)", "log in (`hf auth login`)"
        cause: Exception = err
    except RepositoryNotFoundError as err:
        why, todo = "no such model on the hub (or a private one)", "check the id, or log in (`hf auth login`)"
        cause = err
    except (OSError, ConnectionError) as err:  # no cache and no network, or HF_HUB_OFFLINE=1
        from huggingface_hub import constants

        why = ("not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids a download" if constants.HF_HUB_OFFLINE
               else f"not in the Hugging Face cache and the hub cannot be reached ({_first_line(err)})")
        todo, cause = f"download it where the hub can be reached (`hf download {path}`)", err
    raise FileNotFoundError(f"{setting}: cannot get the model '{path}': {why}; {todo}, or set {setting} to a local "
                            "model folder") from cause


def _first_line(err: BaseException) -> str:
    """The innermost cause of a hub error, in one short line (`ConnectError: [Errno -2] Name or service not known`)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]


def load_target_config(path: str) -> Any:
    """The target's Hugging Face config (its text config for multimodal targets)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_dir(path))
    return getattr(config, "text_config", None) or config


def tokenizer_ids(path: str) -> tuple[int | None, list[int]]:
    """(number of token ids the tokenizer knows, ids of its special tokens that can serve as MASK).

    (None, []) for a folder without a tokenizer: then the mask id must be given explicitly. The MASK candidates
    (`mask_candidates`) are the special tokens nothing writes: see there.
    """
    from transformers import AutoTokenizer

    folder = resolve_model_dir(path)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None, []
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return len(tokenizer), mask_candidates(tokenizer)


def mask_candidates(tokenizer: Any) -> list[int]:
    """Ids of the special tokens a target never reads in its data, in the order MASK takes them (docs/method.md 3).

    A candidate is marked special by the tokenizer (so text never tokenizes into it), is none of its named tokens
    (bos, eos, pad, unk, ...), and does not appear in its chat template (which writes `<|im_start|>`, `<think>` and
    the like). Reserved tokens (Llama 3's `<|reserved_special_token_N|>`) come first, then the rest by id (SmolLM2's
    `<repo_name>`, id 3). The data are checked for the chosen id when a run starts (`check_mask_absent`).
    """
    kinds = ("bos", "eos", "unk", "pad", "sep", "cls", "mask")
    named = {getattr(tokenizer, f"{kind}_token_id", None) for kind in kinds}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    free = [i for i, t in sorted(tokenizer.added_tokens_decoder.items())
            if t.special and i not in named and str(t.content) not in template]
    return sorted(free, key=lambda i: "reserved" not in str(tokenizer.added_tokens_decoder[i].content))


def load_target_io(path: str) -> tuple[Tensor, Tensor]:
    """The target's input embedding and LM head weights `[V, H]`, read alone from its safetensors."""
    from safetensors import safe_open

    folder = resolve_model_dir(path)
    files = weight_map(folder)

    def find(suffix: str) -> str | None:
        hits = sorted(k for k in files if k.endswith(suffix) and "vision" not in k)
        return hits[0] if hits else None

    embed_key, head_key = find("embed_tokens.weight"), find("lm_head.weight")
    if embed_key is None:
        raise KeyError(f"target: no '*embed_tokens.weight' tensor in {folder}")
    head_key = head_key or embed_key  # tied embeddings

    def read(key: str) -> Tensor:
        with safe_open(folder / files[key], "pt") as f:
            return f.get_tensor(key)

    return read(embed_key), read(head_key)



def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name of a Hugging Face folder (sharded with an index, or one file)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return {k: single.name for k in f.keys()}  # noqa: SIM118


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face base model."""
    for name in ("layers", "h", "blocks"):
        layers = getattr(model, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
