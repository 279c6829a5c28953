"""Data-path benchmark on the CPU: packed batches per second from memory and from a feature cache, against what
one H200 drafter step consumes (benchmarks/results/h200-2026-11-29.json); prints one JSON object.

    python benchmarks/data_bench.py [--docs 2000] [--out benchmarks/results/data-cpu.json]

The data: synthetic chat conversations (1-3 turns) whose token lengths follow a log-normal with median 700
and sigma 0.8, cut at the recipe's max_length 3072 (a stand-in for regenerated, thinking-off chat data),
tokenized with a byte-level BPE trained here (no download) through the project's own chat-template path.
Cached features use a small K*H (disk stays small); the time per batch is fitted as `a + b * K*H` over two
widths and extrapolated to Qwen3-8B's K*H = 5 * 4096. The cache is read from the page cache (just written):
the figures are the CPU's side of the work; a disk must also deliver the bytes/s printed beside them.
glibc serves allocations over 32 MB (every Qwen3-8B-sized batch) with fresh pages that the kernel zeroes on
first touch, but reuses smaller ones; the benchmark runs with MALLOC_MMAP_THRESHOLD_=1 MiB so that the small
test widths pay for fresh pages too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_lightning.data import DFlashDataModule
from dflash_lightning.data.conversations import resolve_files, tokenize_files
from dflash_lightning.data.feature_cache import (
    MANIFEST,
    VERSION,
    data_header,
    dequantize,
    quantize_fp8,
    sample_checksums,
)
from dflash_lightning.data.feature_cache_writer import plan_shards, write_shard
from dflash_lightning.long_runs.atomic import write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.measured
from benchmarks.measured import STEP_RESULT, h200_drafter_step_s  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B_FEATURE_DIM = 5 * 4096  # K * H of the recipe
CHECKSUMS = os.environ.get("DATA_BENCH_CHECKSUMS", "1") == "1"  # 0: shards without per-sample crc32 (old caches)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(folder: Path, words: list[str], rng: random.Random) -> float:
    """A byte-level BPE (8K vocab) with a ChatML template saved to `folder`; returns tokens per word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = [" ".join(rng.choices(words, k=50)) for _ in range(4000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=8192, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    sample = " ".join(text[:200])
    return len(fast(sample)["input_ids"]) / len(sample.split())


def write_conversations(path: Path, docs: int, words: list[str], tokens_per_word: float,
                        rng: random.Random) -> None:
    """`docs` chat records with log-normal token lengths (median 700, sigma 0.8, 64..3072)."""
    with path.open("w") as f:
        for _ in range(docs):
            total = min(3072, max(64, int(rng.lognormvariate(math.log(700), 0.8))))
            turns = rng.choices([1, 2, 3], weights=[0.7, 0.2, 0.1])[0]
            messages = []
            for _ in range(turns):
                n = total / turns / tokens_per_word - 12  # the template adds about 6 tokens per message
                prompt = max(3, int(n * 0.25))
                messages += [{"role": "user", "content": " ".join(rng.choices(words, k=prompt))},
                             {"role": "assistant", "content": " ".join(rng.choices(words, k=max(8, int(n) - prompt)))}]
            f.write(json.dumps({"messages": messages}) + "\n")


def make_cache(folder: Path, dm: DFlashDataModule, feature_format: str, feature_dim: int) -> float:
    """A feature cache of `dm`'s training samples with random features (what the writer lays out); GB written."""
    samples = dm.train_samples
    header = data_header(dm, {"train": (dm.train_paths, samples)})
    per_token = feature_dim * (2 if feature_format == "bf16" else 1) + 5 + (4 if feature_format == "fp8" else 0)
    shards = plan_shards("train", samples.lengths(), per_token, 500_000_000)
    block = torch.randn(4096, feature_dim)  # tiled: random bits cost more to make than to read
    folder.mkdir(parents=True)
    size = 0
    for shard in shards:
        a, b = int(samples.starts[shard["first"]]), int(samples.starts[shard["end"]])
        feats = block.repeat(math.ceil((b - a) / 4096), 1)[: b - a]
        tensors = ({"features": feats.bfloat16()} if feature_format == "bf16"
                   else dict(zip(("features", "scales"), quantize_fp8(feats), strict=True)))
        tensors |= {"input_ids": samples.input_ids[a:b], "loss_mask": samples.loss_mask[a:b],
                    "starts": samples.starts[shard["first"] : shard["end"] + 1] - a}
        if CHECKSUMS:  # what the writer stores, and the reader then checks for every sample it serves
            tensors["crc32"] = sample_checksums(tensors)
        shard.update(write_shard(folder / shard["file"], tensors, {}))
        size += shard["bytes"]
    header["splits"]["train"]["shards"] = shards
    write_json(folder / MANIFEST, {"version": VERSION, "feature_format": feature_format, "feature_dim": feature_dim,
                                   "target": {"path": "random"}, **header, "writing": {}, "complete": True})
    return size / 1e9


def batches_per_s(dm: DFlashDataModule, limit: int) -> tuple[float, int, float]:
    """(batches/s, batches, real tokens per batch) over up to `limit` batches of one epoch, in this process."""
    loader = dm.train_dataloader()
    it = iter(loader)
    next(it)  # first batch pays for the epoch's packing
    start, n, tokens = time.perf_counter(), 0, 0
    for batch in it:
        n += 1
        tokens += int(batch["doc_lengths"].sum())
        if n == limit:
            break
    return n / (time.perf_counter() - start), n, tokens / max(1, n)


def main() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
        os.execv(sys.executable, [sys.executable, *sys.argv])  # glibc reads it at process start
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1000, help="synthetic conversations")
    parser.add_argument("--batches", type=int, default=1000, help="most batches timed per measurement")
    parser.add_argument("--widths", default="512,2048", help="two K*H widths of the cache to fit time against")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a DataLoader worker is one process of one thread; figures are per worker
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(6000)]
    widths = [int(w) for w in args.widths.split(",")]
    gpu_step_s = h200_drafter_step_s()
    gpu_batches_per_s = 1 / gpu_step_s
    result = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "malloc_mmap_threshold": int(os.environ["MALLOC_MMAP_THRESHOLD_"]),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "docs": args.docs,
              "gpu_drafter_step_s": gpu_step_s, "gpu_drafter_step_from": str(STEP_RESULT.relative_to(ROOT)),
              "gpu_batches_per_s": gpu_batches_per_s}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokens_per_word = make_tokenizer(root / "tok", words, rng)
        data = root / "train.jsonl"
        write_conversations(data, args.docs, words, tokens_per_word, rng)

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(root / "tok")
        start = time.perf_counter()
        samples = tokenize_files(resolve_files([str(data)], "train_files"), tok, "bench", "auto", None, 3072, 32,
                                 "error")
        tokenize_s = time.perf_counter() - start
        lengths = samples.lengths()
        result["samples"] = {
            "kept": len(samples), "tokens": int(samples.input_ids.numel()), "mean_length": statistics.mean(lengths),
            "median_length": statistics.median(lengths), "p90_length": sorted(lengths)[int(0.9 * len(lengths))],
            "max_length": max(lengths), "supervised_fraction": float(samples.loss_mask.float().mean()),
        }
        result["tokenize"] = {"seconds": tokenize_s, "docs_per_s": len(samples) / tokenize_s,
                              "tokens_per_s": samples.input_ids.numel() / tokenize_s}

        def datamodule(budget: int, feature_cache: str | None = None) -> DFlashDataModule:
            dm = DFlashDataModule([str(data)], tokenizer=str(root / "tok"), token_budget=budget, max_documents=64,
                                  max_length=3072, cache_dir=str(root / "tokens"), feature_cache=feature_cache)
            dm.setup("fit")  # tokenized once, then loaded from cache_dir
            return dm

        # one cache at a time, measured at both budgets, then deleted: the page cache holds it whole
        first, budgets, rates = datamodule(8192), (3072, 8192), {}
        for fmt in ("bf16", "fp8"):
            for width in widths:
                folder = root / f"cache-{fmt}-{width}"
                gb = make_cache(folder, first, fmt, width)
                result.setdefault("cache_gb_written", {})[f"{fmt}/{width}"] = gb
                for budget in budgets:
                    rates[budget, fmt, width] = batches_per_s(datamodule(budget, str(folder)), args.batches)[0]
                shutil.rmtree(folder)

        for budget in budgets:
            dm = datamodule(budget)
            rate, n, tokens = batches_per_s(dm, args.batches)
            rows = dm._packer.rows_per_epoch
            epoch_s = rows / rate
            entry = {
                "rows_per_epoch": rows, "real_tokens_per_batch": tokens,
                "padding_fraction": 1 - tokens / budget,
                "memory_batches_per_s": rate,
                # the first epoch also tokenizes every sample once (later epochs reuse them)
                "memory_batches_per_s_first_epoch_with_tokenization": rows / (epoch_s + tokenize_s),
                "tokenization_s_per_batch": tokenize_s / rows,
            }
            for fmt in ("bf16", "fp8"):
                times = []
                for width in widths:
                    times.append(1 / rates[budget, fmt, width])
                    entry[f"cache_{fmt}_batches_per_s_at_{width}"] = rates[budget, fmt, width]
                slope = (times[1] - times[0]) / (widths[1] - widths[0])  # seconds per batch per feature column
                t_full = times[0] + slope * (QWEN3_8B_FEATURE_DIM - widths[0])
                item = 2 if fmt == "bf16" else 1
                bytes_per_batch = tokens * QWEN3_8B_FEATURE_DIM * item
                entry[f"cache_{fmt}_qwen3_8b"] = {
                    "batches_per_s_one_worker": 1 / t_full,
                    "feature_bytes_per_batch": bytes_per_batch,
                    "read_bytes_per_s_one_worker": bytes_per_batch / t_full,
                    "workers_for_one_gpu": gpu_batches_per_s * t_full,
                    "disk_bytes_per_s_for_one_gpu": gpu_batches_per_s * bytes_per_batch,
                }
            # fp8 batches are dequantised on the GPU (on_after_batch_transfer); this is what a CPU would pay
            values, scales = quantize_fp8(torch.randn(budget, widths[1]))
            start = time.perf_counter()
            for _ in range(10):
                dequantize(values, scales)
            per_col = (time.perf_counter() - start) / 10 / widths[1]
            entry["fp8_dequant_on_cpu_s_per_batch_qwen3_8b"] = per_col * QWEN3_8B_FEATURE_DIM
            entry["gpu_batches_per_s"] = gpu_batches_per_s
            result[f"token_budget_{budget}"] = entry
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
