"""What a training step computes that no loss or metric uses, counted on the recipe's batches (CPU, no model).

Packs fit_bench's synthetic conversations (log-normal lengths, median 700 tokens) with the project's own data
module at a token budget, draws each step's anchors as training does, and counts per step: padding tokens (the
target and the drafter's context run over them), invalid anchors (fewer candidates than anchors), and block
slots of weight 0 (slot 0, which skips the head since 2026-12-02; labels outside the loss mask, past the document
or the budget). The head's share is 4 A (B - 1) H V of the step's FLOPs, so unused head rows cost that share.

    python benchmarks/unused_compute.py --budget 3072 --anchors 512 --out X.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.data_bench import make_tokenizer, write_conversations  # noqa: E402
from dflash_lightning.blocks import anchor_seed, base_slot_weights, block_labels, select_anchors  # noqa: E402
from dflash_lightning.data import DFlashDataModule  # noqa: E402


def count(budget: int, anchors: int, block: int, docs: int, steps: int, seed: int = 0) -> dict:
    """Per-step averages of the unused work over `steps` packed batches of `docs` synthetic conversations."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(6000)]
    with tempfile.TemporaryDirectory() as tmp:
        folder, data = Path(tmp) / "tok", Path(tmp) / "train.jsonl"
        write_conversations(data, docs, words, make_tokenizer(folder, words, rng), rng)
        dm = DFlashDataModule([str(data)], tokenizer=str(folder), token_budget=budget, block_size=block)
        dm.setup("fit")
        totals = dict(tokens=0, padding=0, anchors_invalid=0, slots=0, slot0=0, slots_unweighted=0)
        weights = base_slot_weights(block, "dpace", 7.0)
        n = 0
        for n, batch in enumerate(dm.train_dataloader(), 1):
            g = torch.Generator().manual_seed(anchor_seed(seed, "train", 0, n - 1))
            a, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], anchors, g)
            _, w = block_labels(batch["input_ids"], batch["loss_mask"], batch["doc_ids"], a, valid, weights)
            totals["tokens"] += budget
            totals["padding"] += int((batch["doc_ids"] < 0).sum())
            totals["anchors_invalid"] += int((~valid).sum())
            totals["slots"] += anchors * block
            totals["slot0"] += anchors
            totals["slots_unweighted"] += int((w[:, 1:] == 0).sum())  # slots 1.. that no loss or metric reads
            if n == steps:
                break
    per = {k: v / n for k, v in totals.items()}
    return {"steps": n, "budget": budget, "anchors": anchors, "block": block, "per_step": per,
            "padding_fraction": per["padding"] / budget, "invalid_anchor_fraction": per["anchors_invalid"] / anchors,
            "slot0_fraction": 1 / block, "unweighted_slot_fraction_of_slots_1_on": per["slots_unweighted"]
            / (anchors * (block - 1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/unused_compute.py "
              + " ".join(sys.argv[1:]), **count(args.budget, args.anchors, args.block, args.docs, args.steps)}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
