"""Features from a vLLM engine against the in-process target, on the embedded tiny target, on this machine's CPU.

1. Feature rate: context tokens per second of the tiny default's features (layer id 3 of 6, fp32) over the first
   `--rows` packed rows of its training data (1024 tokens each), from the in-process target (`FeatureExtractor`,
   SDPA) and from the engine (`EngineExtractor`, all of a row's documents in flight; one row at a time, and
   `--streams` rows at a time as the placement keeps them).
2. The trainer's idle fraction: `fit --config configs/tiny.yaml` for `--steps` steps, colocated and fed by the
   engine through the placement's bounded queue; idle is the share of the wall time (after `--warmup` steps) the
   training thread spends outside the drafter's steps (waiting for a batch and its features, or computing the
   features itself when colocated).

The engine is `vllm serve` of the tiny target from the engine venv (tools/engine_venv.sh), started here:

    python benchmarks/engine_bench.py --engine-python /tmp/dflash-engine-venv/bin/python --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = str(ROOT / "dflash_lightning/assets/tiny/target_model")
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
IDLE_OUT = "ENGINE_BENCH_IDLE_OUT"


class IdleClock(Callback):
    """Seconds inside the drafter's steps against the wall time, from the end of step `warmup`; written as JSON."""

    def __init__(self, warmup: int = 5) -> None:
        self.warmup, self.busy, self.t0, self.start = warmup, 0.0, None, None

    def setup(self, trainer, pl_module, stage) -> None:
        step = pl_module.training_step

        def timed(*args, **kwargs):
            self.start = time.perf_counter()
            return step(*args, **kwargs)

        pl_module.training_step = timed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if trainer.global_step == self.warmup:
            self.t0 = now
        elif self.t0 is not None:
            self.busy += now - self.start

    def on_train_end(self, trainer, pl_module) -> None:
        wall = time.perf_counter() - self.t0
        steps = trainer.global_step - self.warmup
        Path(os.environ[IDLE_OUT]).write_text(json.dumps({
            "steps": steps, "wall_s": wall, "step_s": self.busy / steps, "idle_fraction": 1 - self.busy / wall}))


def rows(n: int) -> list[dict[str, torch.Tensor]]:
    """The first `n` packed training rows of the tiny default (its data module, seed 0)."""
    import yaml

    from dflash_lightning.data import DFlashDataModule

    data = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())["data"]
    dm = DFlashDataModule([str(ROOT / p) for p in data["train_files"]], tokenizer=TINY,
                          token_budget=data["token_budget"], max_documents=data["max_documents"], block_size=16)
    dm.setup("fit")
    out = []
    for batch in dm.train_dataloader():
        out.append(batch)
        if len(out) == n:
            return out
    return out


def rate(extract, batches, streams: int = 1) -> dict[str, float]:
    """Context tokens (all T of each row; real ones apart) per second through `extract`, `streams` rows at once."""
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda b: extract(b["input_ids"], b["position_ids"]), batches))
    seconds = time.perf_counter() - start
    tokens = sum(b["input_ids"].numel() for b in batches)
    real = sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    return {"seconds": seconds, "rows": len(batches), "tokens_per_s": tokens / seconds,
            "document_tokens_per_s": real / seconds}


def fit(placement: str, steps: int, warmup: int, work: Path, extra: list[str]) -> dict:
    """`fit --config configs/tiny.yaml` in a child process with IdleClock: its figures."""
    import subprocess

    folder = work / f"fit-{placement}"
    idle = folder / "idle.json"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dflash_lightning", "fit", "--config", "configs/tiny.yaml",
           f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0", "--trainer.logger=false",
           "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={folder}",
           "--trainer.callbacks=[]", "--trainer.callbacks+=" + json.dumps(
               {"class_path": "benchmarks.engine_bench.IdleClock", "init_args": {"warmup": warmup}}),
           "--spec_eval.every_n_steps=0", "--preemption.resume=never",
           f"--target.placement={placement}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), IDLE_OUT: str(idle)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return {"command": "python " + shlex.join(cmd[1:]), **json.loads(idle.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", required=True, help="python of the engine venv (tools/engine_venv.sh)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflash-engine-bench"), help="runs and the engine log")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    from dflash_lightning.target_model.engine import (
        EngineClient,
        EngineExtractor,
        EngineProcess,
        aux_layer_ids,
        serve_command,
        wait_ready,
    )
    from dflash_lightning.target_model.features import FeatureExtractor

    layer_ids = [3]  # the tiny default's one-layer drafter: [L // 2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    storage = "/dev/shm/dflash-engine-bench" if Path("/dev/shm").is_dir() else str(args.work / "hidden-states")
    serve = serve_command(TINY, layer_ids, 6, False, storage, max_model_len=1024)
    serve[0] = str(Path(args.engine_python).parent / "vllm")
    serve += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
              "--max-num-batched-tokens", "4096"]
    args.work.mkdir(parents=True, exist_ok=True)
    engine = EngineProcess(shlex.join(serve), args.work / "engine.log", CPU_ENV).start()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        client = EngineClient(url, aux_layer_ids(layer_ids, 6, False), 128)
        wait_ready([client], engine, 900)
        batches = rows(args.rows)
        ours = EngineExtractor(client, layer_ids, torch.float32)
        rate(ours.extract, batches[:2])  # warm-up
        reference = FeatureExtractor.from_pretrained(TINY, layer_ids, torch.float32, "cpu", "sdpa")
        rate(reference.extract, batches[:2])
        result = {
            "date": "2026-12-04", "machine": f"CPU, {os.cpu_count()} cores (shared)", "target": "tiny (6 x 128, fp32)",
            "layer_ids": layer_ids, "row_tokens": batches[0]["input_ids"].numel(),
            "serve_command": shlex.join(serve),
            "in_process": rate(reference.extract, batches),
            "engine_1_row": rate(ours.extract, batches),
            f"engine_{args.streams}_rows": rate(ours.extract, batches, args.streams),
        }
        result["fit_colocated"] = fit("colocated", args.steps, args.warmup, args.work, [])
        result["fit_engine"] = fit("engine", args.steps, args.warmup, args.work,
                                   [f"--target.engine_urls=[{url}]", f"--target.engine_streams={args.streams}"])
    finally:
        engine.stop()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
