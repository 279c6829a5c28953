"""The vLLM and SGLang commands that serve a drafter folder (`serve_commands`), and what `export` prints of them
(`print_serve_commands`); each part adds its own keys, flags and notes.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from dflash_lightning.config import DrafterConfig


def serve_commands(folder: str | Path, cfg: DrafterConfig, target: str | None = None) -> dict[str, str]:
    """The vLLM and SGLang commands that serve a drafter folder for its target, with the trained block size; an
    engine without a runtime for the preset (`Preset.vllm_method` or `sglang_algorithm` None) has none.

    vLLM never reads a DFlash `block_size`: its block is 1 + `num_speculative_tokens`, so that is set to the drafts
    of a block (`BlockLayout.drafts`: B - 1, DSpark's anchor-first block B), with the parts' own keys
    (`Part.speculative_config`). SGLang reads `block_size` itself; its `--speculative-<algorithm>-block-size` flag
    states it anyway, so the command says what is served.
    """
    model = shlex.quote(str(target)) if target else "TARGET_MODEL"
    preset, commands = cfg.preset, {}
    if preset.vllm_method is not None:
        spec = {"method": preset.vllm_method, "model": str(folder),
                "num_speculative_tokens": cfg.layout.drafts(cfg.block_size)}
        for part in preset.parts:
            spec |= part.speculative_config(getattr(cfg, part.name))
        commands["vllm"] = f"vllm serve {model} --speculative-config {shlex.quote(json.dumps(spec))}"
    algorithm = preset.sglang_algorithm
    if algorithm is not None:
        draft = shlex.quote(str(folder))
        flags = [flag for part in preset.parts for flag in part.sglang_args(getattr(cfg, part.name))]
        commands["sglang"] = " ".join([
            f"python -m sglang.launch_server --model-path {model} --speculative-algorithm {algorithm}",
            f"--speculative-draft-model-path {draft} --speculative-{algorithm.lower()}-block-size {cfg.block_size}",
            *flags])
    return commands


def print_serve_commands(folder: Path, cfg: DrafterConfig, target: str | None, dtype: str) -> None:
    """Print the vLLM and SGLang commands that serve `folder`, and what to watch for."""
    commands = serve_commands(folder, cfg, target)
    drafts = cfg.layout.drafts(cfg.block_size)
    architecture = cfg.preset.architecture
    if "vllm" in commands:
        print(f"serve with vLLM (num_speculative_tokens = {drafts} drafts of a block of {cfg.block_size}):\n"
              f"  {commands['vllm']}")
    else:
        print(f"vLLM: no runtime serves this drafter (a {architecture} with its parts), so no vLLM command")
    if "sglang" in commands:
        print(f"serve with SGLang (reads block_size {cfg.block_size} and dtype {dtype} from config.json):\n"
              f"  {commands['sglang']}")
    else:
        print(f"SGLang: no runtime serves this drafter (a {architecture} with its parts), so no SGLang command")
    for part in cfg.preset.parts:
        for note in part.serve_notes(getattr(cfg, part.name)):
            print(note)
    if target is None:
        print("TARGET_MODEL: the target model the drafter was trained for")
    if dtype == "float32" and "sglang" in commands:
        print("float32 weights: SGLang's --dtype auto serves a float32 config in float16; against a bfloat16 target "
              "export with --dtype bfloat16")


__all__ = ["print_serve_commands", "serve_commands"]
