"""Data parallel on the CPU (gloo): the loss and gradient of a global batch do not depend on the rank count."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import packed_batch
from test_model import tiny_drafter

from dflash_lightning.blocks import select_anchors, slot_weights

ROWS = [packed_batch([30, 18], 64, seed=1), packed_batch([60], 64, seed=2)]  # very different weight sums
FEATURES = [torch.randn(64, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]


def row_inputs(i: int):
    b = ROWS[i]
    anchors, valid = select_anchors(b["loss_mask"], b["doc_ids"], 12 - 8 * i, torch.Generator().manual_seed(i))
    return (FEATURES[i], b["input_ids"], b["position_ids"], b["doc_ids"], b["loss_mask"], anchors, valid,
            slot_weights(8, 4.0).double())


def _rank(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    drafter = tiny_drafter(block=8)
    drafter(*row_inputs(rank)).loss.backward()
    grad = drafter.fc.weight.grad.clone()
    dist.all_reduce(grad)  # what DDP does: the mean of the ranks' gradients
    out[rank] = grad / world
    dist.destroy_process_group()


def test_two_rank_gradient_equals_single_process_global_batch():
    drafter = tiny_drafter(block=8)
    sums, total = 0, 0
    for i in range(2):  # reference: sum(w * CE) / sum(w) over the union of both rows, plain CE
        args = row_inputs(i)
        hidden = drafter.block_hidden(*args[:4], *args[5:7])
        labels, weights = drafter(*args).labels, drafter(*args).weights
        ce = F.cross_entropy(drafter.logits(hidden).flatten(0, 1), labels.flatten(), reduction="none")
        sums = sums + (ce * weights.flatten()).sum()
        total += weights.sum()
    (sums / total).backward()
    expected = drafter.fc.weight.grad
    out = mp.Manager().dict()
    mp.start_processes(_rank, args=(2, 29533, out), nprocs=2, join=True, start_method="fork")
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], expected)


def test_two_process_ddp_fit_through_the_cli(tmp_path):
    """`--trainer.strategy=ddp --trainer.devices=2` on the CPU (gloo) runs the tiny config to the end.

    With the target placed apart: each rank takes one of the two listed target devices.
    """
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    cmd = [sys.executable, "-m", "dflash_lightning", "fit", "--config", "configs/tiny.yaml",
           "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_steps=3", "--model.metrics_every=1",
           "--trainer.log_every_n_steps=1", "--target.placement=separate", "--target.target_devices=[cpu,cpu]",
           f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
           f"--trainer.logger.save_dir={tmp_path}", "--trainer.callbacks=[]", "--spec_eval.every_n_steps=0"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()
    header = metrics[0].split(",")
    losses = [float(row.split(",")[header.index("train/loss")]) for row in metrics[1:]
              if row.split(",")[header.index("train/loss")]]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses)
