"""Throughput of the online pipeline (target features + drafter step) over several GPUs of one machine.

One invocation measures one layout through the project's own `TargetFeatures` and `DFlashModule` under
`Trainer.fit` and appends one JSON line to `--out` (global rank 0). On the 2-GPU machine:

    python benchmarks/scaling_bench.py --make-target /tmp/qwen3-8b-random          # random Qwen3-8B weights
    python benchmarks/scaling_bench.py --target /tmp/qwen3-8b-random --devices 1 --out scaling.jsonl
    python benchmarks/scaling_bench.py --target /tmp/qwen3-8b-random --devices 2 --strategy ddp --out scaling.jsonl
    python benchmarks/scaling_bench.py --target /tmp/qwen3-8b-random --devices 2 --strategy ddp --placement sharded ...
    python benchmarks/scaling_bench.py --target /tmp/qwen3-8b-random --devices 1 --trainer-gpus 1 \\
        --placement separate --target-devices cuda:0 --out scaling.jsonl      # 1 target GPU, 1 trainer GPU

Context tokens/s counts every rank's tokens (ranks x token budget / step seconds); scaling efficiency is
that over (GPUs used x the one-GPU co-located rate), given with `--baseline`. `--cpu-smoke` runs a tiny
version on the CPU (gloo) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.step_bench import MASK_ID, QWEN3_8B, RandomData  # noqa: E402
from dflash_lightning.config import DrafterConfig  # noqa: E402
from dflash_lightning.module import DFlashModule  # noqa: E402
from dflash_lightning.target_model import TargetFeatures  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "dflash_lightning/assets/tiny/target_model"


def make_target(folder: Path, feature_layers: int = 34) -> None:
    """A random Qwen3-8B-shaped checkpoint: all weights of the first `feature_layers` layers, embedding, head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": feature_layers})).bfloat16()
    model.save_pretrained(folder)
    Qwen3Config(**QWEN3_8B).save_pretrained(folder)  # 36 layers: those past the features are never read


class Throughput(Callback):
    """Seconds of the steady steps after `warmup`, synchronised at both ends only; peak memory."""

    def __init__(self, warmup: int, measured: int) -> None:
        self.warmup, self.measured = warmup, measured

    def sync(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.t0 = time.perf_counter()
        if batch_idx == self.warmup:
            self.sync(pl_module.device)
            self.warmup_s = time.perf_counter() - self.t0
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self.t1 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.warmup + self.measured - 1:
            self.sync(pl_module.device)
            self.step_s = (time.perf_counter() - self.t1) / self.measured
            cuda = pl_module.device.type == "cuda"
            self.peak_gb = torch.cuda.max_memory_allocated(pl_module.device) / 1e9 if cuda else 0.0
            self.loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-target", type=Path, default=None, help="write a random Qwen3-8B checkpoint here")
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--devices", type=int, default=1, help="trainer ranks")
    parser.add_argument("--trainer-gpus", default=None, help="comma list of the trainer's GPU indices")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--placement", default="colocated", choices=["colocated", "separate", "sharded"])
    parser.add_argument("--target-devices", default="", help="comma list, for placement separate")
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--baseline", type=float, default=None, help="one-GPU co-located tokens/s")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    if args.make_target:
        make_target(args.make_target)
        return
    torch.set_float32_matmul_precision("high")
    smoke = args.cpu_smoke
    target = TINY if smoke else args.target
    budget, anchors = (256, 16) if smoke else (8192, 512)
    drafter = DrafterConfig(num_layers=1 if smoke else 5, block_size=16, mask_token_id=None if smoke else MASK_ID)
    module = DFlashModule(str(target), drafter, token_budget=budget, num_anchors=anchors, compile=not smoke,
                          metrics_every=8)
    features = TargetFeatures(str(target), dtype="float32" if smoke else "bfloat16", placement=args.placement,
                              target_devices=[d for d in args.target_devices.split(",") if d] or None,
                              layer_ids=module.drafter_config.target_layer_ids, token_budget=budget)
    timer = Throughput(args.warmup, args.steps)
    devices = [int(i) for i in args.trainer_gpus.split(",")] if args.trainer_gpus else args.devices
    trainer = Trainer(
        accelerator="cpu" if smoke else "gpu", devices=devices, strategy=args.strategy,
        precision="32-true" if smoke else "bf16-true", max_steps=args.warmup + args.steps,
        enable_checkpointing=False, gradient_clip_val=1.0, enable_model_summary=False, logger=False,
        callbacks=[features, timer], use_distributed_sampler=False,  # every rank: its own stream of batches
        enable_progress_bar=False,
    )
    data = RandomData(budget, max_documents=8 if smoke else 64, steps=args.warmup + args.steps + 1,
                      vocab=200 if smoke else MASK_ID)
    trainer.fit(module, datamodule=data)
    if not trainer.is_global_zero:
        return
    ranks = trainer.world_size
    gpus = ranks + (len(features.target_devices) if args.placement == "separate" else 0)
    rate = ranks * budget / timer.step_s
    row = {"devices": ranks, "gpus": gpus, "strategy": args.strategy, "placement": args.placement,
           "target_devices": features.target_devices, "steps": args.warmup + args.steps, "step_s": timer.step_s,
           "context_tokens_per_s": rate, "warmup_s": timer.warmup_s, "peak_gb_rank0": timer.peak_gb,
           "last_loss": timer.loss, "gpu": torch.cuda.get_device_name() if not smoke else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if args.baseline:
        row["scaling_efficiency"] = rate / (gpus * args.baseline)
    print(json.dumps(row), flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
