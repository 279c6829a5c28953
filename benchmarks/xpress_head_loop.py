"""XPress's loss inside the chunked head loop at the Qwen3-8B shape: cold compile time, recompiles, step time and
peak memory, compiled and eager, beside the plain loop (section 4's CE), per `model.head_chunk_size`.

The loop is what `model.compile` compiles (`torch.compile(chunked_head_loss, dynamic=False)`), with the XPress
part's inputs made as its `head_inputs` makes them (the hidden cache by autograd, under bf16 autocast over fp32
weights, as `bf16-mixed` trains). Each compiled case starts from a fresh inductor cache. Prints one JSON line per
case and writes them all to `--out`:

    python benchmarks/xpress_head_loop.py --out xpress-head-loop.json

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
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_lightning.loss import LossSettings, chunked_head_loss  # noqa: E402
from dflash_lightning.parts.xpress import XPress, XPressSettings  # noqa: E402


def inputs(part: XPress | None, shape: dict, device: str, seed: int) -> tuple[tuple, dict]:
    """The loop's arguments for one random batch (rows of slots 1..B-1 of A blocks) and the part's inputs."""
    a, b, h, v = shape["anchors"], shape["block"], shape["hidden"], shape["vocab"]
    g = torch.Generator(device).manual_seed(seed)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    hidden = torch.randn(a, b, h, generator=g, device=device, dtype=dt).requires_grad_()
    labels = torch.randint(0, v, (a, b), generator=g, device=device)
    weights = torch.exp(-torch.arange(b, device=device) / 4.0).expand(a, b).clone()
    weights[:, 0] = 0
    weights *= torch.rand(a, b, generator=g, device=device) > 0.1
    parts = ()
    if part is not None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            hcache = part.head.hidden_cache(hidden)  # [A, B, 2r]
        teacher = torch.randn(a * (b - 1), h, generator=g, device=device, dtype=dt)
        parts = ((part, (hcache, labels, labels[:, 0], teacher)),)
    rows = hidden[:, 1:].flatten(0, 1)
    return (rows, labels[:, 1:].flatten(), weights[:, 1:].flatten()), {"parts": parts, "hidden": hidden}


def run_case(name: str, part: XPress | None, shape: dict, chunk: int, compiled: bool, device: str, head) -> dict:
    """Seconds of the first step (the compile, when compiled), of the next steps, peak memory, recompiles."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-xpress-")  # cold
    fn = torch.compile(chunked_head_loss, dynamic=False) if compiled else chunked_head_loss
    settings = LossSettings(loss_weights="decay")

    def step(seed: int) -> None:
        (rows, labels, weights), extra = inputs(part, shape, device, seed)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            total, *_ = fn(rows, head, labels, weights, chunk, 10, shape["block"] - 1, settings, parts=extra["parts"])
        total.backward()
        if device == "cuda":
            torch.cuda.synchronize()

    def peak() -> float | None:
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step(0)
    first, first_peak = time.perf_counter() - start, peak()  # the compile's own allocations (autotuning) too
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for seed in range(1, 6):
        start = time.perf_counter()
        step(seed)
        times.append(time.perf_counter() - start)
    return {"case": name, "chunk": chunk, "compiled": compiled, "first_step_s": round(first, 2),
            "step_s": round(sorted(times)[len(times) // 2], 4), "first_peak_gib": first_peak, "peak_gib": peak(),
            "recompiles": sum(counters["recompiles"].values()), "graph_breaks": sum(counters["graph_break"].values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small shape (smoke run)")
    parser.add_argument("--chunks", default="4096,2048", help="head_chunk_size values")
    parser.add_argument("--cases", default="plain,xpress", help="plain (the loop's CE alone) and/or xpress")
    parser.add_argument("--eager", action="store_true", help="also time each case eager")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = ({"anchors": 12, "block": 5, "hidden": 24, "vocab": 48, "rank": 16, "mlp": 64} if args.small else
             {"anchors": 512, "block": 16, "hidden": 4096, "vocab": 151936, "rank": 256, "mlp": 512})
    dev = args.device
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    head = (torch.randn(shape["vocab"], shape["hidden"], device=dev) / shape["hidden"] ** 0.5).to(dt)
    config = SimpleNamespace(xpress=XPressSettings(rank=shape["rank"], mlp_hidden=shape["mlp"]),
                             vocab_size=shape["vocab"], hidden_size=shape["hidden"], block_size=shape["block"],
                             loss_gamma=4.0)
    part = XPress(config).to(dev)  # fp32 master weights
    results = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        for case in args.cases.split(","):
            for compiled in ((False, True) if args.eager else (True,)):
                out = run_case(case, part if case == "xpress" else None, shape, chunk, compiled, dev, head)
                out["device"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
                print(json.dumps(out), flush=True)
                results.append(out)
    if args.out:
        args.out.write_text(json.dumps({"shape": shape, "torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()
