"""Content fingerprints of a target and its tokenizer, recorded by feature caches and checkpoints.

Cheap enough to compute at every start, strict enough to catch a fine-tune or a changed chat template.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash_lightning.target_model.loading import resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def sha256_path(path: Path) -> str:
    """Content hash of a file, or of a folder's files (relative names and bytes, in name order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def target_fingerprint(path: str) -> dict[str, str]:
    """Hashes of the target's config and of its weights' headers and first MiB of data (cheap, catches fine-tunes)."""
    folder = resolve_model_dir(path)
    config = json.loads((folder / "config.json").read_text())
    weights = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            weights.update(f.read(n) + f.read(1 << 20))
    return {"config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
            "weights_sha256": weights.hexdigest()}


def tokenizer_sha256(path: str) -> str:
    """Hash of the tokenizer's files (vocabulary, merges, special tokens, chat template)."""
    folder = resolve_model_dir(path)
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).exists():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()
