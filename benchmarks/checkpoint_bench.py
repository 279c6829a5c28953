"""Checkpoint save benchmark: the stall on the training thread and the write time of a synchronous save
(AtomicCheckpointIO) against a background one (AsyncAtomicCheckpointIO), for a drafter state of a given size;
with --ranks N, the preemption save of a DDP run (a distributed checkpoint, every rank writing its share) against
the single file rank 0 writes otherwise, and the load of each.

    python benchmarks/checkpoint_bench.py --out benchmarks/results/h200-<date>-checkpoint.json   # 12.6 GB, cuda
    python benchmarks/checkpoint_bench.py --device cpu --size-gb 0.05 --dir /tmp/x --out x.json  # a smoke run
    python benchmarks/checkpoint_bench.py --device cpu --size-gb 0.4 --ranks 2 --out x.json      # gloo ranks

The state is laid out as the Qwen3-8B recipe's checkpoint: fp32 weights (a third of the bytes) and AdamW's two
moments, in [4096, 4096] blocks. While each background write runs, the benchmark changes every tensor in place
(as optimizer steps do), runs a loop of small tensor ops as the training thread's own CPU work (its rate against
the same loop with no write: `host_loop_during_write_vs_idle`), and then checks that the file holds the values of
the save's moment (`--checks`: where the finite check and the checksums run). Files are written
into --dir (default: a folder beside --out, so on the disk the runs use); it needs about twice the size free.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins import CheckpointIO

import dflash_lightning.long_runs.async_save as async_save
from dflash_lightning.long_runs.async_save import AsyncAtomicCheckpointIO, on_gpu
from dflash_lightning.long_runs.atomic import write_json
from dflash_lightning.long_runs.checkpointing import AtomicCheckpointIO, checkpoint_bytes, load_checkpoint
from dflash_lightning.long_runs.distributed_checkpoint import save_distributed

BLOCK = (4096, 4096)  # fp32: 64 MiB, a drafter projection of Qwen3-8B's width


def drafter_state(size_bytes: int, device: torch.device) -> dict:
    """A Lightning-shaped checkpoint of about `size_bytes`: weights + two AdamW moments per weight."""
    per_weight = 3 * 4  # bytes per parameter: weight, exp_avg, exp_avg_sq (fp32)
    numel = max(1, size_bytes // per_weight)
    weights, state = {}, {}
    block = BLOCK[0] * BLOCK[1]
    for i in range((numel + block - 1) // block):
        n = min(block, numel - i * block)
        shape = BLOCK if n == block else (n,)
        weights[f"drafter.w{i}"] = torch.full(shape, float(i), device=device)
        state[i] = {"step": torch.tensor(1.0, device=device), "exp_avg": torch.zeros(shape, device=device),
                    "exp_avg_sq": torch.ones(shape, device=device)}
    return {"state_dict": weights, "optimizer_states": [{"state": state, "param_groups": []}], "global_step": 0,
            "drafter_config": {}}


def train_in_place(ckpt: dict) -> None:
    """What optimizer steps do to a saved state while it is written: change every tensor in place."""
    for t in ckpt["state_dict"].values():
        t.add_(1)
    for s in ckpt["optimizer_states"][0]["state"].values():
        for t in s.values():
            t.add_(1)


def check_file(path: Path, expected_first: float) -> None:
    """The file holds the values of the save's moment, not those of later steps."""
    ckpt = load_checkpoint(path, mmap=True)
    got = float(ckpt["state_dict"]["drafter.w0"].flatten()[0])
    if got != expected_first:
        raise SystemExit(f"{path}: holds {got}, the state at the save was {expected_first}: the snapshot is torn")


def host_loop_rate(seconds: float) -> float:
    """Iterations per second of a loop of small tensor ops: the training thread's own CPU work (launching kernels,
    Python), which a background write must leave alone."""
    x, n, start = torch.ones(64, 64), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        y = x
        for _ in range(20):
            y = y * (1 + 1e-4) + 0.1
        n += 1
    return n / (time.perf_counter() - start)


class ChecksInWriter(CheckpointIO):
    """AtomicCheckpointIO behind a plain CheckpointIO: the background writer then takes the finite check and the
    checksums on its own CPU threads, as before 2026-12-03 (`--checks writer`, for comparison)."""

    def __init__(self) -> None:
        self.inner = AtomicCheckpointIO()

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location=None):
        return self.inner.load_checkpoint(path)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)

    @property
    def last_write(self):
        return self.inner.last_write


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, ranks: int, port: int, size: int, device: str, folder: str, rounds: int, out: dict) -> None:
    """One DDP-like rank with the same state as every rank: per round, rank 0 writes the single file, then all
    ranks the folder; the disk is flushed (os.sync) before each save, so none pays for the one before."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=ranks)
    if device != "cpu":
        torch.cuda.set_device(rank)
    ckpt = drafter_state(size, torch.device(device if device == "cpu" else f"cuda:{rank}"))
    single, distributed = [], []
    for _ in range(rounds):
        os.sync()
        dist.barrier()
        if rank == 0:  # what a preemption save of a DDP run wrote before: one file, from rank 0
            start = time.perf_counter()
            AtomicCheckpointIO().save_checkpoint(ckpt, Path(folder) / "single.ckpt")
            single.append(time.perf_counter() - start)
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        written = save_distributed(ckpt, Path(folder) / "distributed.ckpt")
        distributed.append(time.perf_counter() - start)
    out[rank] = {"single_file_s": single, "distributed_s": distributed, "rank_bytes": written.rank_bytes,
                 "total_bytes": written.total_bytes, "size_bytes": checkpoint_bytes(ckpt)}
    dist.destroy_process_group()


def distributed(args: argparse.Namespace, size: int, folder: Path) -> dict:
    """--ranks N: the distributed preemption save against the single file, and their loads (one process)."""
    out = mp.Manager().dict()
    mp.start_processes(_rank, args=(args.ranks, 29561, size, args.device, str(folder), args.saves, out),
                       nprocs=args.ranks, join=True, start_method="fork" if args.device == "cpu" else "spawn")
    per_rank = [out[r] for r in range(args.ranks)]
    loads = {}
    for name in ("single.ckpt", "distributed.ckpt"):  # checksums verified, as at every resume (from the page cache)
        start = time.perf_counter()
        load_checkpoint(folder / name)
        loads[name] = time.perf_counter() - start
    single = per_rank[0]["single_file_s"]
    save = [max(times) for times in zip(*(r["distributed_s"] for r in per_rank), strict=True)]  # the slowest rank
    return {
        "size_bytes": per_rank[0]["size_bytes"], "ranks": args.ranks, "rounds": args.saves,
        "single_file": {"bytes": (folder / "single.ckpt").stat().st_size, "save_s": single,
                        "load_s": loads["single.ckpt"]},
        "distributed": {"bytes": per_rank[0]["total_bytes"], "rank_bytes": [r["rank_bytes"] for r in per_rank],
                        "save_s": save, "load_s": loads["distributed.ckpt"]},
        "save_speedup_median": sorted(single)[len(single) // 2] / sorted(save)[len(save) // 2],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=12.6, help="checkpoint size in GB (1e9 bytes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--saves", type=int, default=3,
                        help="background saves (the first allocates host memory); with --ranks, rounds of both saves")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: beside --out)")
    parser.add_argument("--no-pin", action="store_true", help="background copies in pageable host memory")
    parser.add_argument("--ranks", type=int, default=0,
                        help="N > 0: the distributed preemption save on N ranks (gloo on the CPU) instead")
    parser.add_argument("--checks", choices=["auto", "writer", "before-copy"], default="auto",
                        help="where a background save takes the finite check and checksums: auto (as the project "
                             "does: before the copy for GPU tensors, in the writer for CPU ones), writer (its CPU "
                             "threads, as before 2026-12-03), before-copy (on the training thread, CPU tensors too)")
    parser.add_argument("--out", type=Path, required=True, help="JSON result")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    size = int(args.size_gb * 1e9)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".checkpoint-bench-", dir=args.dir or args.out.parent))
    try:
        free = shutil.disk_usage(folder).free
        if free < 2.1 * size:
            raise SystemExit(f"{folder}: {free / 1e9:.1f} GB free, the benchmark writes two {size / 1e9:.1f} GB files")
        if args.ranks:
            result = {"benchmark": "checkpoint_bench --ranks", "date": time.strftime("%Y-%m-%d"),
                      "device": str(device), "cpus": os.cpu_count(), "torch": torch.__version__,
                      "dir": str(args.dir or args.out.parent), **distributed(args, size, folder)}
            write_json(args.out, result)
            print(json.dumps(result, indent=1))
            return result
        ckpt = drafter_state(size, device)
        synchronize(device)
        nbytes = checkpoint_bytes(ckpt)

        sync_path = folder / "sync.ckpt"
        start = time.perf_counter()
        AtomicCheckpointIO().save_checkpoint(ckpt, sync_path)
        sync_s = time.perf_counter() - start
        sync_path.unlink()

        idle_rate = host_loop_rate(2.0)
        if args.checks == "before-copy":  # the GPU tensors' way, for CPU tensors too (put back at the end)
            async_save.on_gpu = lambda state_dict: True
        io = AsyncAtomicCheckpointIO(ChecksInWriter() if args.checks == "writer" else None, pin_memory=not args.no_pin)
        saves = []
        for i in range(args.saves):
            path = folder / f"async-{i % 2}.ckpt"  # two names, as a rotation: a save never overwrites the one in flight
            expected = float(ckpt["state_dict"]["drafter.w0"].flatten()[0])
            start = time.perf_counter()
            io.save_checkpoint(ckpt, path)  # waits for the save before: measured in wait_s
            stall = time.perf_counter() - start
            train_in_place(ckpt)  # the next steps, during the write
            synchronize(device)
            rates = []
            while not io._last.done():  # the training thread's own work while the write runs
                rates.append(host_loop_rate(0.25))
            io.wait()
            done = time.perf_counter() - start
            timing = io.timings[-1]
            check_file(path, expected)
            saves.append({"stall_s": stall, "wait_s": timing.wait_s, "copy_s": timing.copy_s,
                          "write_s": timing.write_s, "save_to_complete_s": done,
                          "file_bytes": path.stat().st_size,
                          "host_loop_during_write_vs_idle": {"mean": sum(rates) / len(rates) / idle_rate,
                                                             "min": min(rates) / idle_rate} if rates else None})
        io.teardown()
    finally:
        async_save.on_gpu = on_gpu
        shutil.rmtree(folder, ignore_errors=True)
    later = saves[1:] or saves
    result = {
        "benchmark": "checkpoint_bench", "date": time.strftime("%Y-%m-%d"), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "python": sys.version.split()[0], "dir": str(args.dir or args.out.parent),
        "size_bytes": nbytes, "pin_memory": not args.no_pin, "host_copy_bytes": io.host_copy.nbytes,
        "checks": args.checks,
        "torch_threads": torch.get_num_threads(),
        "sync": {"stall_s": sync_s, "write_s": sync_s, "GBps": nbytes / sync_s / 1e9},
        "async": saves,
        "async_stall_s_after_first": max(s["stall_s"] for s in later),
        "async_write_GBps": nbytes / max(s["write_s"] for s in later) / 1e9,
    }
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "async"}, indent=1))
    return result


if __name__ == "__main__":
    main()
