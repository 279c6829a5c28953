"""Packed-batch builders, conversation records, a batch recorder and a short fit's config shared by the tests."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback

# How the tests start their gloo ranks: a rank forked from a pytest process that already ran threads (compiles)
# cannot run backward on PyTorch's CUDA wheels (docs/versions.md).
RANKS_START = "spawn"


def end_ranks() -> None:
    """End a test's rank once its results are out: a barrier, then the process exits without tearing the process
    group down. On torch 2.7.1, gloo's worker thread frees a finished collective (its tensors Python objects, so it
    needs the GIL) while `destroy_process_group` holds the GIL and joins that thread: a deadlock that a barrier first
    made rarer but not impossible (.ci/run's minimum part hung there again on 2026-12-05). Each caller has put its
    results in a manager dict or a file before this; nothing after it runs."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def packed_batch(doc_lengths: list[int], total: int, vocab: int = 40, seed: int = 0,
                 supervise_from: int = 2) -> dict[str, torch.Tensor]:
    """A packed row of `total` tokens: documents laid out from 0, padding after; loss mask from a prefix on."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, doc, mask = [], [], [], []
    for d, n in enumerate(doc_lengths):
        ids += torch.randint(4, vocab, (n,), generator=g).tolist()
        pos += list(range(n))
        doc += [d] * n
        mask += [i >= min(supervise_from, n - 1) for i in range(n)]
    pad = total - len(ids)
    assert pad >= 0
    ids += [0] * pad
    pos += list(range(pad))
    doc += [-1] * pad
    mask += [False] * pad
    return {
        "input_ids": torch.tensor(ids), "position_ids": torch.tensor(pos),
        "doc_ids": torch.tensor(doc, dtype=torch.int32), "loss_mask": torch.tensor(mask),
    }



class RecordRows(Callback):
    """Appends `epoch anchor_seed global_step` of every training batch to `out/rank<r>.txt` (any process)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with open(f"{self.out}/rank{trainer.global_rank}.txt", "a") as f:
            f.write(f"{trainer.current_epoch} {int(batch['anchor_seed'])} {trainer.global_step}\n")


class RecordWeights(Callback):
    """Appends `global_step sha256-of-every-weight's-bytes` after each optimizer step to `out/weights.txt`."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from dflash_lightning.long_runs import lightning_compat as compat

        if compat.inside_accumulation(trainer):
            return
        digest = hashlib.sha256()
        for name, tensor in sorted(pl_module.state_dict().items()):
            digest.update(name.encode() + tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        with open(f"{self.out}/weights.txt", "a") as f:
            f.write(f"{trainer.global_step} {digest.hexdigest()}\n")


class KillAt(Callback):
    """SIGKILLs its own process at the start of the `nth` batch trained while `global_step == at_step` (n = 2: one
    micro-batch of step at_step + 1 trained, under gradient accumulation): a crash with no save and no teardown."""

    def __init__(self, at_step: int, nth: int = 2) -> None:
        self.at_step, self.nth, self.seen = at_step, nth, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            self.seen += 1
            if self.seen == self.nth:
                os.kill(os.getpid(), signal.SIGKILL)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write_jsonl(path: Path, records: list[dict], bad_line_at: int | None = None) -> Path:
    """One JSON record per line; with `bad_line_at`, a malformed line inserted at that index."""
    lines = [json.dumps(r) for r in records]
    if bad_line_at is not None:
        lines.insert(bad_line_at, '{"messages": [broken')
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_fit_config(work: Path, steps: int) -> Path:
    """configs/tiny.yaml for a short `fit` into `work/run` (its last.ckpt under run/checkpoints): `steps` steps, no
    logger, no validation or progress bar, the checkpoint callback only; the config file written."""
    import yaml

    root = Path(__file__).parents[1]
    config = yaml.safe_load((root / "configs" / "tiny.yaml").read_text())
    config["trainer"].update(default_root_dir=str(work / "run"), max_steps=steps, logger=False,
                             val_check_interval=10_000, enable_progress_bar=False)
    callbacks = [c for c in config["trainer"]["callbacks"] if "ModelCheckpoint" in c["class_path"]]
    callbacks[0]["init_args"]["dirpath"] = str(work / "run" / "checkpoints")
    config["trainer"]["callbacks"] = callbacks
    config["spec_eval"]["prompts"] = None
    (work / "fit.yaml").write_text(yaml.safe_dump(config))
    return work / "fit.yaml"
