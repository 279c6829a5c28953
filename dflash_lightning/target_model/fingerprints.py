"""Content fingerprints of a target and its tokenizer, recorded by feature caches and checkpoints.

Cheap enough to compute at every start, strict enough to catch a fine-tune or a changed chat template.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from dflash_lightning.config import ConfigError
from dflash_lightning.target_model.loading import resolve_model_dir

log = logging.getLogger(__name__)

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


SLICES_PER_TENSOR = 8  # evenly spaced slices of each weight's bytes that its fingerprint reads
SLICE_BYTES = 4096  # 2048 bf16 values: a fine-tune that moves a fraction of the values changes every slice


class TargetChangedError(ConfigError):
    """A checkpoint or feature cache made with other target weights (same shapes) than the target given now."""


def weights_fingerprint(path: str) -> str:
    """sha256 of every safetensors weight's name, dtype, shape and 8 slices of 4 KiB spread over its bytes (a
    smaller weight whole), in name order: the same for a re-sharded copy, other for a fine-tune of any weight
    (a change confined to bytes between the slices, e.g. a few embedding rows, is not seen).

    32 KiB read per weight whatever its size: 399 weights (Qwen3-8B's count) take 0.23 s from a cold disk, 25 ms
    cached; hashing every byte would take 45 s for 16 GB.
    """
    folder = resolve_model_dir(path)
    weights: dict[str, tuple[Path, int, dict]] = {}  # name -> (file, first data byte, header entry)
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        weights |= {name: (file, 8 + n, info) for name, info in header.items()}
    digest = hashlib.sha256()
    fds: dict[Path, int] = {}
    try:
        for name in sorted(weights):
            file, base, info = weights[name]
            fd = fds.get(file)
            if fd is None:
                fd = fds[file] = os.open(file, os.O_RDONLY)
            begin, end = (base + o for o in info["data_offsets"])
            digest.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
            if end - begin <= SLICES_PER_TENSOR * SLICE_BYTES:
                digest.update(os.pread(fd, end - begin, begin))
                continue
            step = (end - begin - SLICE_BYTES) // (SLICES_PER_TENSOR - 1)
            for i in range(SLICES_PER_TENSOR):
                digest.update(os.pread(fd, SLICE_BYTES, begin + i * step))
    finally:
        for fd in fds.values():
            os.close(fd)
    return digest.hexdigest()


def target_fingerprint(path: str) -> dict[str, str]:
    """Hashes of the target's config and of its weights' content (`weights_fingerprint`)."""
    folder = resolve_model_dir(path)
    config = json.loads((folder / "config.json").read_text())
    return {"config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
            "weights_fingerprint": weights_fingerprint(str(folder))}


def check_same_target(recorded: str | None, current: str, made: str, target: str, accept: bool) -> None:
    """Refuse target weights whose fingerprint differs from the one `made` (a checkpoint or cache) records, unless
    `accept` (then one logged line); a record without one (an older version) is accepted with one logged line."""
    if recorded is None:
        log.warning(f"{made} records no content fingerprint of its target (written by an older version): the "
                    f"weights of {target} are taken as the ones it was made with, unchecked")
    elif recorded != current and accept:
        log.warning(f"{made} was made with other weights than those of the target {target} (fingerprint "
                    f"{recorded[:12]} -> {current[:12]}); going on with them, as model.accept_target_change says")
    elif recorded != current:
        raise TargetChangedError(
            f"{made} was made with other target weights than those of {target} (same config, weights fingerprint "
            f"{recorded[:12]} there, {current[:12]} here: a fine-tune or another checkpoint of the model?); give the "
            "target it was made with, or --model.accept_target_change=true to go on with this one on purpose"
        )


def tokenizer_sha256(path: str) -> str:
    """Hash of the tokenizer's files (vocabulary, merges, special tokens, chat template)."""
    folder = resolve_model_dir(path)
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).exists():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()
