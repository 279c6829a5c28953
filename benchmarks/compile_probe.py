"""Where the drafter's cold compile goes: block-mask construction and the flex attention kernels, timed apart.

Times, each from a fresh compiler cache, at the Qwen3-8B recipe shape (8192 context tokens, 512 anchors
x 16, 32/8 heads of 128): `create_block_mask` compiled (how the mask was built before `tiled_block_mask`),
`tiled_block_mask` (eager, no compile), and the first flex_attention forward and backward. Also checks
that both masks list the same tiles. Prints one JSON object. On an H200:

    python benchmarks/compile_probe.py

(H200, 2026-11-29, `benchmarks/results/h200-2026-11-29-compile-probe.json`: create_block_mask compile
231 s, tiled_block_mask 0.13 s first and 4 ms after, flex forward 3.3 s and backward 5.6 s, same tiles.)
`--device cpu --small` is a quick smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.step_bench import random_batch  # noqa: E402
from dflash_lightning.blocks import block_mask_mod, select_anchors, tiled_block_mask  # noqa: E402


def timed(fn, device: str):
    """Result of `fn()` and its wall seconds, synchronised on CUDA."""
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def tile_map(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Dense `[query tiles, key tiles]` bool map of the tiles a BlockMask lists."""
    rows = torch.arange(indices.shape[-1], device=indices.device)[None, :] < num_blocks[0, 0][:, None]
    out = torch.zeros(indices.shape[-2:], dtype=torch.bool, device=indices.device)
    out.scatter_(1, indices[0, 0].long(), rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small shape (smoke run)")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-probe-")  # cold, always
    T, A, B, heads, kv_heads, d = (512, 32, 16, 4, 2, 32) if args.small else (8192, 512, 16, 32, 8, 128)
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    batch = {k: v.to(dev) for k, v in random_batch(T, 64 if not args.small else 8, 0).items()}
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], A, torch.Generator(dev).manual_seed(0))
    Q, KV = A * B, T + A * B
    result: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                    "shape": {"T": T, "A": A, "B": B, "heads": heads, "kv_heads": kv_heads, "head_dim": d}}

    def tiled_mask():
        return tiled_block_mask(batch["doc_ids"], anchors, valid, B)

    tiled, result["tiled_block_mask_first_s"] = timed(tiled_mask, dev)
    _, result["tiled_block_mask_s"] = timed(tiled_mask, dev)
    mask_mod = block_mask_mod(batch["doc_ids"], anchors, valid, B)
    made, result["create_block_mask_compile_s"] = timed(
        lambda: create_block_mask(mask_mod, None, None, Q, KV, device=dev, _compile=True), dev
    )
    result["same_tiles"] = bool(
        torch.equal(tile_map(tiled.kv_num_blocks, tiled.kv_indices), tile_map(made.kv_num_blocks, made.kv_indices))
        and torch.equal(tile_map(tiled.full_kv_num_blocks, tiled.full_kv_indices),
                        tile_map(made.full_kv_num_blocks, made.full_kv_indices))
    )
    grad = dev == "cuda"  # flex_attention has no backward on the CPU
    q = torch.randn(1, heads, Q, d, device=dev, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(1, kv_heads, KV, d, device=dev, dtype=dtype, requires_grad=grad) for _ in range(2))
    flex = torch.compile(flex_attention)
    out, result["flex_forward_compile_s"] = timed(lambda: flex(q, k, v, block_mask=tiled, enable_gqa=True), dev)
    if grad:
        _, result["flex_backward_compile_s"] = timed(lambda: out.sum().backward(), dev)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
