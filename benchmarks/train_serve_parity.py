"""Does a GPU compute what the CPU's reference path computes? The target's features and the drafter's validation.

`features`: the target's hidden states of a packed row of documents, under each attention backend the features
can take (`auto`: packed flex attention on CUDA; `sdpa`: a dense mask), against each document's own forward through
transformers (its default attention, no packing). A backend that lets a token see past its document or its own
position (a future token) shows as a difference far above the dtype's rounding.

`validate`: `python -m dflash_lightning validate` of one checkpoint under several settings (the CPU in float32, the
GPU in float32 eager, the GPU in bf16 compiled, the target's features through sdpa); the validation metrics of each.
The training estimate (`val/tau`) of one drafter on the same rows must agree across them within rounding.

    python benchmarks/train_serve_parity.py features --target T --device cuda --out F.json
    python benchmarks/train_serve_parity.py validate --config C --ckpt K --out V.json [--settings NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name: the overrides of one `validate` (besides --config and --ckpt_path)
SETTINGS = {
    "cpu-fp32": ["--trainer.accelerator=cpu", "--trainer.precision=32-true", "--model.compile=false",
                 "--target.compile=false", "--target.dtype=float32", "--target.attn_implementation=sdpa"],
    "gpu-fp32-eager": ["--trainer.accelerator=gpu", "--trainer.precision=32-true", "--model.compile=false",
                       "--target.compile=false", "--target.dtype=float32"],
    "gpu-fp32-eager-sdpa": ["--trainer.accelerator=gpu", "--trainer.precision=32-true", "--model.compile=false",
                            "--target.compile=false", "--target.dtype=float32", "--target.attn_implementation=sdpa"],
    "gpu-bf16-compiled": ["--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed", "--model.compile=true",
                          "--target.compile=true", "--target.dtype=bfloat16"],
    "gpu-bf16-compiled-sdpa": ["--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed", "--model.compile=true",
                               "--target.compile=true", "--target.dtype=bfloat16",
                               "--target.attn_implementation=sdpa"],
}


def features(target: str, device: str, dtypes: list[str], docs: list[int], seed: int) -> dict:
    """Max |packed - per-document| of every backend and dtype, beside the per-document states' own scale."""
    from transformers import AutoConfig, AutoModel

    from dflash_lightning.target_model import FeatureExtractor
    from dflash_lightning.target_model.loading import resolve_model_dir

    folder = resolve_model_dir(target)
    text = AutoConfig.from_pretrained(folder)
    layers = text.num_hidden_layers
    layer_ids = sorted({1, layers // 2, layers - 2})
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, text.vocab_size, (sum(docs),), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])
    out: dict = {"target": target, "device": device, "docs": docs, "layer_ids": layer_ids, "results": {}}
    for name in dtypes:
        dtype = getattr(torch, name)
        model = AutoModel.from_pretrained(folder, dtype=dtype).to(device).eval()
        expected, start = [], 0
        with torch.no_grad():
            for n in docs:
                hs = model(input_ids=ids[None, start:start + n].to(device), output_hidden_states=True).hidden_states
                expected.append(torch.cat([hs[j + 1][0] for j in layer_ids], -1).float())
                start += n
        expected = torch.cat(expected)
        del model
        for attn in ("auto", "sdpa"):
            extractor = FeatureExtractor.from_pretrained(folder, layer_ids, dtype, device, attn_implementation=attn)
            got = extractor(ids.to(device), pos.to(device)).float()
            diff = (got - expected).abs()
            per_doc, start = [], 0
            for n in docs:
                per_doc.append(round(diff[start:start + n].max().item(), 5))
                start += n
            out["results"][f"{name}/{attn}"] = {
                "backend": extractor.model.config._attn_implementation, "max_abs_diff": diff.max().item(),
                "per_doc_max_abs_diff": per_doc, "mean_abs_diff": diff.mean().item(),
                "scale_max_abs": expected.abs().max().item(), "scale_mean_abs": expected.abs().mean().item()}
            print(name, attn, out["results"][f"{name}/{attn}"], flush=True)
            del extractor
    return out


def validate(config: str, ckpt: str, names: list[str], extra: list[str]) -> dict:
    """The validation metrics of `ckpt` under each named setting."""
    from dflash_lightning.commands.cli import cli_main

    out: dict = {"config": config, "ckpt": ckpt, "extra": extra, "results": {}}
    for name in names:
        start = time.perf_counter()
        cli = cli_main(["validate", "--config", config, "--ckpt_path", ckpt, *SETTINGS[name], *extra])
        metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
        out["results"][name] = {"seconds": round(time.perf_counter() - start, 1), "metrics": metrics}
        print(name, json.dumps(out["results"][name]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    f = sub.add_parser("features")
    f.add_argument("--target", required=True)
    f.add_argument("--device", default="cuda")
    f.add_argument("--dtypes", default="float32,bfloat16")
    f.add_argument("--docs", default="300,45,700,200", help="document lengths of the packed row")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out", required=True)
    v = sub.add_parser("validate")
    v.add_argument("--config", required=True)
    v.add_argument("--ckpt", required=True)
    v.add_argument("--settings", default=",".join(SETTINGS))
    v.add_argument("--set", action="append", default=[], help="one more override for every setting (repeatable)")
    v.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.part == "features":
        result = features(args.target, args.device, args.dtypes.split(","), [int(n) for n in args.docs.split(",")],
                          args.seed)
    else:
        unknown = [n for n in args.settings.split(",") if n not in SETTINGS]
        if unknown:
            parser.error(f"--settings: unknown {unknown}; known {list(SETTINGS)}")
        result = validate(args.config, args.ckpt, args.settings.split(","), args.set)
    result["date"] = time.strftime("%Y-%m-%d")
    result["torch"] = torch.__version__
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
