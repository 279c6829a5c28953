"""Batch-1 tokens per second of the target alone and of speculative decoding, same prompts, greedy, in this decoder.

Both run `BatchedDecoder` at N = 1 with a static KV cache of one fixed size for every prompt, so that on CUDA the
target's verify step (the block's q tokens), the target-alone step (1 token) and the drafter's block step replay as
CUDA graphs (`--no-graphs`: eager). Warm-up prompts, decoded both ways untimed, capture the graphs. Timed per prompt:
the decode steps after the prefill, synchronised (`Generation.seconds`); the prefill is reported apart. Tokens
counted: every output token (the prefill's first included, cut at the stop token and the budget), as z-lab's
`dflash` benchmark counts them (docs/serving.md, "Measuring speed"). At temperature 0 the outputs must be equal:
mismatches are counted and fail the run.

    python benchmarks/decode_speed.py --target T --drafter runs/x/checkpoints/last.ckpt \
        --prompts dflash_lightning/assets/smollm2/data/heldout.jsonl --num-prompts 16 --max-new-tokens 256 \
        --device cuda --dtype bfloat16 --out benchmarks/results/h100-decode-speed.json
    python benchmarks/decode_speed.py --smoke --out /tmp/smoke.json   # CPU, the tiny target, a random drafter
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "dflash_lightning/assets/tiny"


def smoke_models(dtype: str, device: str = "cpu"):
    """The tiny shipped target, its tokenizer and a random one-layer drafter of block 4 (untrained), on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.model import DFlashDrafter
    from dflash_lightning.target_model import DTYPES, load_target_config, tokenizer_ids

    folder = str(TINY / "target_model")
    cfg = DrafterConfig(num_layers=1, block_size=4, gamma=4.0)
    cfg = cfg.resolved(load_target_config(folder), *tokenizer_ids(folder))
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to(device).eval()
    drafter = DFlashDrafter(cfg).to(device=device, dtype=DTYPES[dtype]).eval()
    return drafter, target, AutoTokenizer.from_pretrained(folder)


def measure(args: argparse.Namespace) -> dict:
    """Decode every prompt with the target alone and speculatively at batch 1; the figures of both and their ratio."""
    from dflash_lightning.decoding.batched import BatchedDecoder
    from dflash_lightning.decoding.evaluate import first_mismatch, pooled_tau, prompt_ids, read_prompts, stop_token_ids

    if args.smoke:
        drafter, target, tokenizer = smoke_models(args.dtype, args.device)
        device, name = args.device, str(TINY / "target_model")
    else:
        from dflash_lightning.commands.evaluate import load_served

        drafter, _, target, tokenizer, name, device = load_served(args.drafter, args.target, args.device, args.dtype)
    rows = read_prompts(args.prompts, args.num_prompts + args.warmup)
    if len(rows) <= args.warmup:
        raise SystemExit(f"{args.prompts}: {len(rows)} prompts, fewer than --warmup {args.warmup} + 1")
    prompts = [torch.tensor(prompt_ids(tokenizer, row), device=device) for row in rows]
    stop = stop_token_ids(tokenizer, target)
    decoder = BatchedDecoder(target, drafter, graphs=not args.no_graphs)
    # one cache size for every prompt: the graphs' shapes never change
    capacity = max(p.numel() for p in prompts) + args.max_new_tokens + 4 * (decoder.drafts + 1)
    for ids in prompts[: args.warmup]:  # untimed: kernel selection, allocation, graph capture
        decoder.target_generate([ids], args.max_new_tokens, stop, capacity=capacity)
        decoder.generate([ids], args.max_new_tokens, stop, capacity=capacity)
    timed, records = prompts[args.warmup:], []
    for ids in timed:
        (base,) = decoder.target_generate([ids], args.max_new_tokens, stop, capacity=capacity)
        (spec,) = decoder.generate([ids], args.max_new_tokens, stop, capacity=capacity)
        records.append({"prompt_tokens": ids.numel(), "target": base, "speculative": spec,
                        "step_tokens": spec.step_tokens, "first_mismatch": first_mismatch(spec.tokens, base.tokens)})

    def speed(key: str) -> dict:
        runs = [r[key] for r in records]
        tokens, seconds = sum(len(g.tokens) for g in runs), sum(g.seconds for g in runs)
        prefill = sum(g.prefill_seconds for g in runs)
        return {"tokens": tokens, "decode_seconds": round(seconds, 4), "prefill_seconds": round(prefill, 4),
                "tokens_per_second": tokens / seconds,
                # z-lab's figure: 1 / the mean over prompts of decode seconds per output token
                "tokens_per_second_tpot_mean": 1 / statistics.mean(g.seconds / len(g.tokens) for g in runs),
                "end_to_end_tokens_per_second": tokens / (seconds + prefill)}

    target_speed, spec_speed = speed("target"), speed("speculative")
    report = {
        "target": name, "drafter": args.drafter, "device": str(device), "dtype": args.dtype,
        "gpu": torch.cuda.get_device_name() if str(device).startswith("cuda") else None,
        "cuda_graphs": str(device).startswith("cuda") and not args.no_graphs, "batch_size": 1, "temperature": 0.0,
        "num_prompts": len(timed), "warmup_prompts": args.warmup, "max_new_tokens": args.max_new_tokens,
        "block_size": decoder.block_size, "target_alone": target_speed, "speculative": spec_speed,
        "speedup": spec_speed["tokens_per_second"] / target_speed["tokens_per_second"],
        "speedup_tpot_mean": spec_speed["tokens_per_second_tpot_mean"] / target_speed["tokens_per_second_tpot_mean"],
        "tau_pooled": pooled_tau(records),
        "tau_prompt_mean": statistics.mean(pooled_tau([r]) or 0.0 for r in records),
        "mismatches": sum(r["first_mismatch"] is not None for r in records),
        "command": " ".join(sys.argv),
    }
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target folder or hub id (default: the checkpoint's)")
    parser.add_argument("--drafter", help="a Lightning .ckpt or an exported drafter folder")
    parser.add_argument("--prompts", default=str(TINY / "data/prompts.jsonl"), help="prompts JSONL (evaluate's)")
    parser.add_argument("--num-prompts", type=int, default=16, help="timed prompts (after the warm-up ones)")
    parser.add_argument("--warmup", type=int, default=2, help="prompts decoded both ways first, untimed")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--no-graphs", action="store_true", help="eager steps on CUDA too")
    parser.add_argument("--smoke", action="store_true", help="the tiny target and a random drafter, on the CPU in "
                        "fp32 unless --smoke-device names another (a GPU's graphs checked in seconds)")
    parser.add_argument("--smoke-device", default="cpu", help="--smoke's device (its dtype: --dtype there)")
    parser.add_argument("--out", help="write the report here as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device = args.smoke_device
        args.dtype = "float32" if args.device == "cpu" else args.dtype
    elif args.drafter is None:
        parser.error("--drafter is needed (or --smoke)")
    report = measure(args)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if report["mismatches"]:
        raise SystemExit(f"{report['mismatches']} prompts decoded unlike the target alone at temperature 0")
    return report


if __name__ == "__main__":
    main()
