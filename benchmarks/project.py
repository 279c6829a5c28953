"""Hours of a recipe on one node, projected from the user's own `fit` (benchmarks/fit_bench.py JSON): its measured
step time and context tokens/s, the packing fill and mean conversation length of the data it trained on, the
checkpoint interval of its config, and a measured stall per save (benchmarks/checkpoint_bench.py, or a number).

    python benchmarks/project.py --fit fit.json --gpus 8 --conversations 800000 --epochs 6 \\
        --save-stall-s 1.2 --out projection.json

`--efficiency`: the scaling efficiency; by default the DDP one measured on two H200s (benchmarks/measured.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.measured import SCALING_RESULT, ddp_efficiency  # noqa: E402
from benchmarks.step_bench import projection  # noqa: E402


def project(fit: dict, gpus: int, efficiency: float, conversations: float, epochs: int, save_stall_s: float,
            mean_tokens: float | None = None) -> dict:
    """The projection of one fit_bench result; the fill and the mean length come from the batches it trained on."""
    packing = fit["packing"]
    fill = 1.0 - packing["padding_fraction"]
    mean = mean_tokens or packing["tokens"] / packing["documents"]
    every = fit.get("save_every_n_train_steps")
    result = projection(fit["context_tokens_per_s"], gpus, efficiency, conversations, epochs, mean, fill,
                        save_stall_s, every * fit["step_s"] if every else None)
    return {"fit": {k: fit.get(k) for k in ("date", "config", "fit_args", "device", "step_s")}, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", type=Path, required=True, help="a benchmarks/fit_bench.py result")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--efficiency", type=float, default=ddp_efficiency(),
                        help=f"multi-GPU scaling efficiency (default: the 2-GPU DDP one of {SCALING_RESULT.name})")
    parser.add_argument("--conversations", type=float, default=800e3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--save-stall-s", type=float, default=0.0, help="training stall per periodic save, measured")
    parser.add_argument("--mean-tokens", type=float, default=None,
                        help="mean conversation length of the real data (default: the fit's own data)")
    parser.add_argument("--save-every", type=int, default=None,
                        help="steps between periodic saves (default: the fit's config; the GPU configs say 2000)")
    parser.add_argument("--packing-from", type=Path, default=None,
                        help="take the packing from another fit_bench result of the same data and token budget")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    fit = json.loads(args.fit.read_text())
    if args.packing_from:
        fit["packing"] = json.loads(args.packing_from.read_text())["packing"]
    if args.save_every is not None:
        fit["save_every_n_train_steps"] = args.save_every
    result = project(fit, args.gpus, args.efficiency, args.conversations, args.epochs, args.save_stall_s,
                     args.mean_tokens)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
