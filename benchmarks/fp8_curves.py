"""Loss curves that learn, at the Qwen3-8B drafter shape: bf16-mixed against FP8 recipes, over seeds (issue 26).

A random 8B-shaped target gives features that carry nothing, so its curves never leave the uniform level. Here the
target is the embedded tiny target (a trained Qwen3, hidden 128) seen through a fixed orthonormal map `Q` up to the
8B hidden size: its embedding and head rows, and each of its context layers' outputs, are `x @ Q.T` (4096 wide;
the head's other vocabulary rows are small random ones, so the head keeps the full 151,936 x 4096 shape and FP8
scales it whole). The conversations are sampled from the tiny target itself (`--temperature`, prompts of the
tiny training set), so the drafter learns a real distribution it cannot memorise; the held-out rows are sampled from
the validation prompts. Everything else is the project's: `DFlashModule` at the recipe's drafter shape, compiled,
under a Lightning Trainer, AdamW with warm-up and cosine decay, the recipe's objective and slot weights.

    python benchmarks/fp8_curves.py --arms bf16-mixed,all:tensorwise,all:rowwise_with_gw_hp \
        --seeds 0,1,2 --steps 800 --parallel 3 --speed benchmarks/results/h200-2026-12-02-step-fp8-recipes.json \
        --out X.json
    python benchmarks/fp8_curves.py --arms bf16-mixed@2000,all:tensorwise@2000,bf16-mixed,all:rowwise --steps 400 ...

Each (arm, seed) is one process (`--parallel` at a time on the one GPU: their compiles overlap); a seed fixes the
initial drafter and the order of the rows, the same for every arm, so arms compare pair by pair. An arm written
`ARM@N` runs N steps instead of `--steps` (its own schedule: warm-up and cosine decay over N), so one call can run
long curves of some arms and short ones of others; curves compare only with curves of the same length, the longest
start first. Reported per length and arm: the loss curve (every step), the mean training loss over the last
`--tail` steps and the held-out loss, tau and accuracy after the last step; the gap to bf16-mixed at equal steps
(paired by seed) against the spread of the bf16 seeds; at equal wall time, from each arm's measured step time
(`--speed`, a step_bench JSON: the curves' processes share the GPU, so their own times are not the step's). Also
the unigram entropy of the sampled tokens: the level a drafter reaches from token frequencies alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_bench import MASK_ID, QWEN3_8B, LossCurve, drafter_shape  # noqa: E402

from dflash_lightning.config import DrafterConfig, default_target_layer_ids  # noqa: E402
from dflash_lightning.data.packing import best_fit_decreasing, collate_documents  # noqa: E402
from dflash_lightning.module import DFlashModule  # noqa: E402
from dflash_lightning.target_model import FeatureExtractor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "dflash_lightning" / "assets" / "tiny"
PAD_ROW_SCALE = 0.1  # the head's rows past the tiny vocabulary: this times the projected rows' element std


def up_map(hidden: int, small: int, seed: int = 0) -> torch.Tensor:
    """A fixed `[hidden, small]` matrix with orthonormal columns: dot products of mapped vectors are kept."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(hidden, small, generator=g, dtype=torch.float64))
    return q.float()


def write_standin(folder: Path, hidden: int, vocab: int, layers: int) -> Path:
    """An 8B-shaped target folder (config, embedding, head): the tiny target's embedding and head, mapped up."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config

    if (folder / "model.safetensors").is_file():
        return folder
    tiny = load_file(TINY / "target_model" / "model.safetensors")
    small = tiny["model.embed_tokens.weight"].shape[1]
    q = up_map(hidden, small)
    g = torch.Generator().manual_seed(1)
    weights = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = tiny[name].float() @ q.T  # [V_tiny, hidden]
        rest = torch.randn(vocab - rows.shape[0], hidden, generator=g) * rows.std() * PAD_ROW_SCALE
        weights[name] = torch.cat([rows, rest]).bfloat16()
    shape = {**QWEN3_8B, "hidden_size": hidden, "intermediate_size": 3 * hidden, "vocab_size": vocab,
             "num_attention_heads": hidden // 128, "num_key_value_heads": max(1, hidden // 512),
             "num_hidden_layers": layers}
    folder.mkdir(parents=True, exist_ok=True)
    Qwen3Config(**shape).save_pretrained(folder)
    save_file(weights, folder / "model.safetensors")
    return folder


def prompts(split: str) -> list[list[dict]]:
    """The conversations of the tiny data set cut before their first assistant turn."""
    out = []
    for line in (TINY / "data" / f"{split}.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out.append(messages[:first])
    return out


@torch.no_grad()
def sample_documents(split: str, per_prompt: int, max_new: int, device: str, seed: int, temperature: float,
                     batch: int = 4096) -> list[tuple[list[int], list[bool]]]:
    """Conversations the tiny target writes itself at `temperature`: (token ids, loss mask on its reply)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = TINY / "target_model"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    eos = model.config.eos_token_id
    heads = []
    for messages in prompts(split):
        row = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        heads.append(list(row["input_ids"] if hasattr(row, "keys") else row))
    heads = [h for h in heads for _ in range(per_prompt)]
    torch.manual_seed(seed)
    docs = []
    for start in range(0, len(heads), batch):
        part = heads[start:start + batch]
        width = max(map(len, part))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(h)) + h for h in part], device=device)
        mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in part], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                             top_p=1.0, max_new_tokens=max_new, pad_token_id=tok.pad_token_id, eos_token_id=eos)
        for h, reply in zip(part, out[:, width:].tolist(), strict=True):
            if eos in reply:
                reply = reply[: reply.index(eos) + 1]
            docs.append((h + reply, [False] * len(h) + [True] * len(reply)))
    return docs


def unigram_entropy(docs: list[tuple[list[int], list[bool]]]) -> float:
    """Entropy (nats) of the supervised tokens' frequencies: the loss of a drafter that only knows them."""
    labels = torch.tensor([t for ids, mask in docs for t, m in zip(ids, mask, strict=True) if m])
    p = torch.bincount(labels).float()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def rows_of(docs: list, token_budget: int, max_documents: int, order_seed: int) -> list[dict]:
    """The documents packed best-fit into fixed rows, in an order fixed by `order_seed`."""
    g = torch.Generator().manual_seed(order_seed)
    lengths = [len(ids) for ids, _ in docs]
    indices = torch.randperm(len(docs), generator=g).tolist()
    rows = best_fit_decreasing(lengths, indices, token_budget, max_documents)
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    return [collate_documents([docs[i] for i in row], token_budget, max_documents, 0) for row in rows]


class MappedTinyFeatures(Callback):
    """The tiny target's context features of each row, each layer mapped up by `Q`: `[T, K * hidden]`."""

    def __init__(self, hidden: int, num_layers: int) -> None:
        self.hidden, self.num_layers = hidden, num_layers

    def setup(self, trainer, pl_module, stage):
        folder = str(TINY / "target_model")
        total = json.loads((TINY / "target_model" / "config.json").read_text())["num_hidden_layers"]
        ids = default_target_layer_ids(total, self.num_layers)
        self.extractor = FeatureExtractor.from_pretrained(folder, ids, torch.float32, pl_module.device)
        self.q = up_map(self.hidden, self.extractor.model.config.hidden_size).to(pl_module.device)

    def _features(self, batch):
        small = self.extractor(batch["input_ids"], batch["position_ids"])  # [T, K * h]
        T = small.shape[0]
        big = small.view(T, self.num_layers, -1) @ self.q.T  # [T, K, hidden]
        batch["context_features"] = big.reshape(T, -1).to(torch.bfloat16)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._features(batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._features(batch)


def arm_settings(arm: str) -> dict:
    """`bf16-mixed`, or `MODE:RECIPE` (model.fp8 and model.fp8_recipe under bf16-mixed)."""
    if arm == "bf16-mixed":
        return {"fp8": "none"}
    mode, recipe = arm.split(":")
    return {"fp8": mode, "fp8_recipe": recipe}


def parse_arms(spec: str, steps: int) -> list[tuple[str, int]]:
    """`--arms`: `ARM` or `ARM@STEPS` items -> (arm, steps), the longest first; a malformed item fails here."""
    out = []
    for item in spec.split(","):
        arm, _, length = item.partition("@")
        arm_settings(arm)
        if length and not (length.isdigit() and int(length) > 0):
            raise SystemExit(f"--arms: {item!r}: the steps after @ must be a positive whole number")
        out.append((arm, int(length) if length else steps))
    return sorted(out, key=lambda a: -a[1])


def log_name(arm: str, steps: int, seed: int) -> str:
    return f"{arm.replace(':', '-')}-{steps}-{seed}.log"


def run_one(args: argparse.Namespace) -> dict:
    """One curve: the fit of (`--arm`, `--seed`) over the pool's rows, then the held-out loss and metrics."""
    work = args.work
    pool = torch.load(work / "pool.pt")
    cuda = torch.cuda.is_available()
    drafter = drafter_shape() if args.hidden == 4096 else DrafterConfig(
        num_layers=args.drafter_layers, block_size=16, mask_token_id=min(MASK_ID, args.vocab - 1))
    train = rows_of(pool["train"], args.token_budget, args.max_documents, args.seed)
    held_out = rows_of(pool["val"], args.token_budget, args.max_documents, 0)
    epochs = math.ceil(args.steps / len(train))
    order = [train[i % len(train)] for i in range(epochs * len(train))][: args.steps]
    torch.manual_seed(args.seed)
    module = DFlashModule(str(work / "target"), drafter, token_budget=args.token_budget, num_anchors=args.anchors,
                          lr=args.lr, compile=cuda, metrics_every=8, objective="ce", loss_weights="dpace",
                          **arm_settings(args.arm))
    curve = LossCurve()
    trainer = Trainer(accelerator="gpu" if cuda else "cpu", devices=1,
                      precision="bf16-mixed" if cuda else "32-true", max_steps=args.steps, logger=False,
                      enable_checkpointing=False, gradient_clip_val=1.0, enable_model_summary=False,
                      enable_progress_bar=False, callbacks=[MappedTinyFeatures(args.hidden, drafter.num_layers or 5),
                                                            curve], num_sanity_val_steps=0, limit_val_batches=0)
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=DataLoader(order, batch_size=None, pin_memory=cuda))
    wall = time.perf_counter() - start
    trainer.limit_val_batches = 1.0
    val = trainer.validate(module, dataloaders=DataLoader(held_out, batch_size=None), verbose=False)[0]
    return {"arm": args.arm, "seed": args.seed, "steps": args.steps, "rows": len(train), "epochs": epochs,
            "fit_wall_s": wall, "loss": curve.values(), "held_out": {k: float(v) for k, v in val.items()}}


def summarise(runs: list[dict], tail: int, speed: dict[str, float]) -> dict:
    """Per curve length (steps, as a string key): `summarise_length` of the curves of that length."""
    lengths = sorted({r["steps"] for r in runs if "loss" in r}, reverse=True)
    return {str(n): summarise_length([r for r in runs if r.get("steps") == n], tail, speed) for n in lengths}


def summarise_length(runs: list[dict], tail: int, speed: dict[str, float]) -> dict:
    """Per arm: final loss per seed, held-out figures, the paired gap to bf16-mixed, and the gap at equal wall time."""
    by = {(r["arm"], r["seed"]): r for r in runs if "loss" in r}
    arms = sorted({a for a, _ in by}, key=lambda a: a != "bf16-mixed")
    seeds = sorted({s for _, s in by})
    final = {k: mean(r["loss"][-tail:]) for k, r in by.items()}
    base = [final[("bf16-mixed", s)] for s in seeds if ("bf16-mixed", s) in final]
    spread = max(base) - min(base) if len(base) > 1 else float("nan")
    out = {"bf16_seed_spread_final_loss": spread, "arms": {}}
    for arm in arms:
        mine = [s for s in seeds if (arm, s) in final]
        row = {"final_loss": {s: final[(arm, s)] for s in mine},
               "held_out_loss": {s: by[(arm, s)]["held_out"].get("val/loss") for s in mine},
               "held_out_tau": {s: by[(arm, s)]["held_out"].get("val/tau") for s in mine},
               "held_out_acc": {s: by[(arm, s)]["held_out"].get("val/acc") for s in mine}}
        paired = [final[(arm, s)] - final[("bf16-mixed", s)] for s in mine if ("bf16-mixed", s) in final]
        if paired and arm != "bf16-mixed":
            row["gap_equal_steps"] = sum(paired) / len(paired)
            row["gap_equal_steps_per_seed"] = paired
            row["within_bf16_spread"] = abs(row["gap_equal_steps"]) <= spread
        if arm in speed and "bf16-mixed" in speed and arm != "bf16-mixed":
            # at this arm's last step's wall time, bf16-mixed had run steps * t_arm / t_bf16 steps
            ratio = speed[arm] / speed["bf16-mixed"]
            gaps = []
            for s in mine:
                ref = by.get(("bf16-mixed", s))
                if ref is None:
                    continue
                at = max(tail, int(len(ref["loss"]) * ratio))
                ref_loss = mean(ref["loss"][at - tail:at])
                gaps.append(final[(arm, s)] - ref_loss)
            row["step_s_ratio_vs_bf16"] = ratio
            row["gap_equal_wall_time"] = sum(gaps) / len(gaps) if gaps else None
        out["arms"][arm] = row
    return out


def speeds(path: Path | None) -> dict[str, float]:
    """Step seconds per arm from a step_bench JSON (`precision` and `fp8` rows)."""
    if path is None:
        return {}
    data, out = json.loads(path.read_text()), {}

    def walk(x):
        if isinstance(x, dict):
            if "step_s" in x and "precision" in x:
                arm = x["precision"] if x.get("fp8", "none") == "none" else f"{x['fp8']}:{x.get('fp8_recipe')}"
                out.setdefault(arm, x["step_s"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(data)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="bf16-mixed,all:tensorwise,all:rowwise_with_gw_hp",
                        help="comma list of bf16-mixed or MODE:RECIPE, each optionally @STEPS (else --steps)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--anchors", type=int, default=256)
    parser.add_argument("--max-documents", type=int, default=128)
    parser.add_argument("--lr", type=float, default=6e-4, help="configs/qwen3-8b.yaml's")
    parser.add_argument("--hidden", type=int, default=4096, help="4096: the 8B drafter; smaller for a CPU probe")
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=QWEN3_8B["vocab_size"])
    parser.add_argument("--per-prompt", type=int, default=16, help="sampled conversations per training prompt")
    parser.add_argument("--max-new", type=int, default=256, help="longest sampled reply")
    parser.add_argument("--temperature", type=float, default=0.5,
                        help="sampling temperature of the conversations (the tiny target's entropy per token: 4.7 "
                             "nats at 1, 1.6 at 0.5; at 1 a drafter 15 tokens ahead has little to learn)")
    parser.add_argument("--parallel", type=int, default=3, help="curves run at once")
    parser.add_argument("--start-before-s", type=float, default=None,
                        help="start no curve later than this many seconds after the first (a device call's limit)")
    parser.add_argument("--tail", type=int, default=50, help="steps averaged for a curve's final loss")
    parser.add_argument("--speed", type=Path, default=None, help="step_bench JSON with each arm's step_s")
    parser.add_argument("--work", type=Path, default=Path("runs/fp8-curves"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--from-logs", type=Path, default=None,
                        help="rebuild the report from the curves' logs in this folder (a call that ended early)")
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # one curve, in a child process
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    if args.from_logs is not None:
        runs = [json.loads(line[7:]) for log in sorted(args.from_logs.glob("*.log"))
                for line in log.read_text().splitlines() if line.startswith("RESULT ")]
        report = {"rebuilt_from_logs": sorted(p.name for p in args.from_logs.glob("*.log")), "runs": runs,
                  "summary": summarise(runs, args.tail, speeds(args.speed))}
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps(report["summary"], indent=1))
        return
    arms = parse_arms(args.arms, args.steps)  # a malformed arm fails here, before any sampling
    args.work.mkdir(parents=True, exist_ok=True)
    write_standin(args.work / "target", args.hidden, args.vocab, QWEN3_8B["num_hidden_layers"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (args.work / "pool.pt").is_file():
        t = time.perf_counter()
        pool = {"train": sample_documents("train", args.per_prompt, args.max_new, device, 0, args.temperature),
                "val": sample_documents("val", 4, args.max_new, device, 1, args.temperature)}
        torch.save(pool, args.work / "pool.pt")
        torch.cuda.empty_cache()  # the curves' processes need the GPU memory sampling cached here
        print(f"sampled {len(pool['train'])} + {len(pool['val'])} conversations in {time.perf_counter() - t:.0f} s",
              flush=True)
    pool = torch.load(args.work / "pool.pt")
    data = {"train_conversations": len(pool["train"]), "held_out_conversations": len(pool["val"]),
            "train_tokens": sum(len(i) for i, _ in pool["train"]),
            "unigram_entropy": unigram_entropy(pool["train"]), "uniform_entropy": math.log(args.vocab)}
    shared = ["--work", str(args.work), "--token-budget", str(args.token_budget),
              "--anchors", str(args.anchors), "--max-documents", str(args.max_documents), "--lr", str(args.lr),
              "--hidden", str(args.hidden), "--drafter-layers", str(args.drafter_layers), "--vocab", str(args.vocab)]
    todo = [(a, n, int(s)) for a, n in arms for s in args.seeds.split(",")]  # the longest curves first
    runs, running = [], []
    settings = {k: v for k, v in vars(args).items() if k not in ("arm", "seed")}
    report = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}, "data": data}

    def write() -> None:
        report["runs"] = runs
        report["summary"] = summarise(runs, args.tail, speeds(args.speed))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))

    began = time.perf_counter()
    while todo or running:
        if args.start_before_s is not None and time.perf_counter() - began > args.start_before_s and todo:
            print(f"not started (--start-before-s): {todo}", flush=True)
            report["not_started"] = [list(t) for t in todo]
            todo = []
        while todo and len(running) < args.parallel:
            arm, steps, seed = todo.pop(0)
            cmd = [sys.executable, __file__, "--arm", arm, "--seed", str(seed), "--steps", str(steps), *shared]
            log = open(args.work / log_name(arm, steps, seed), "w")
            running.append((arm, steps, seed, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                               env=os.environ.copy()), log))
        time.sleep(2)
        for item in list(running):
            arm, steps, seed, proc, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            text = (args.work / log_name(arm, steps, seed)).read_text()
            lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
            runs.append(json.loads(lines[-1][7:]) if lines and proc.returncode == 0
                        else {"arm": arm, "seed": seed, "steps": steps, "error": text[-3000:]})
            done = runs[-1]
            print(json.dumps({"arm": arm, "steps": steps, "seed": seed, "error": "error" in done,
                              "final": mean(done["loss"][-args.tail:]) if "loss" in done else None,
                              "held_out": done.get("held_out")}), flush=True)
            write()
    write()
    print(json.dumps({"data": data, "summary": report["summary"]}, indent=1))


if __name__ == "__main__":
    main()
