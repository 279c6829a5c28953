"""Benchmark of the DFlash drafter step and the co-located pipeline on one GPU; prints one JSON object.

Runs the project's own DFlashModule under a Lightning Trainer at the Qwen3-8B recipe shape with random
weights (no download). Reproduce on an H200 with:

    python benchmarks/step_bench.py --out benchmarks/results/h200.json

Long context (configs/qwen3-8b-long.yaml's shape: 32K-token rows of long documents, 2048 anchors, four W=2048
sliding layers):

    python benchmarks/step_bench.py --token-budget 32768 --anchors 2048 --sliding-layers 4 --sliding-window 2048 \
        --doc-tokens 4096,32768 --skip eager,warm --warmup 8 --steps 20 --pipeline-steps 20 --out X.json

FLOPs per step (model FLOPs, forward + backward, no recomputation counted):
  linear layers   6 * tokens * in * out   (q, o, MLP on A*B block rows; k, v on block + context rows; fc on T rows)
  attention       12 * head_dim * heads * visible (query, key) pairs, counted from the batch's block mask
  frozen head     4 * A*B * hidden * vocab (logits forward and the hidden-state gradient; no weight gradient),
                  plus 2 * A*B * hidden * vocab for the teacher's logits when the objective distills
MFU = FLOPs / step seconds / the card's dense bf16 peak (its datasheet's, `DENSE_BF16_TFLOPS`); beside it the
fraction of the bf16 matmul throughput measured on the card (`matmul_fraction`).

Also reported: the compile warm-up (all warm-up steps minus as many steady steps) with a fresh compiler
cache, and again in a new process that finds the cache; recompiles and host syncs (CUDA sync debug mode)
over the steady steps, with progress bar and CSV logger on; a kernel profile of three steps by family.

Precision and FP8 (`--precisions`, `--fp8 mode:recipe,...`): each step against `bf16-mixed` in the same run;
loss curves over the same batches per precision (`--curves`, features that make slots 1..K-1 learnable);
(`--curve-seeds`: per initial-drafter seed); the co-located pipeline with a bf16 and with an FP8 target at
8192/512 and at the recipe's shape (`--recipe-shape`; `--target-compile`: its layers compiled, as
`target.compile` does), the FP8 target's feature difference, and the hours of the Qwen3-8B recipe on one 8-GPU
node from the measured rate (`--mean-tokens`, `--packing-fill`, `--ddp-efficiency`).
`benchmarks/precision_h200.sh` runs these parts in device calls of at most 10 minutes.

For runs that may not finish: every fit prints a JSON line per step (host seconds, frames compiled) into the
partial results ($OUT/bench.json), with the compiler settings it started under; `--stage-timeout S` stops a
configuration after S seconds and reports the stack it was in.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.measured
from benchmarks.measured import SCALING_RESULT, ddp_efficiency  # noqa: E402
from dflash_lightning.blocks import select_anchors
from dflash_lightning.config import VARIANTS, DrafterConfig
from dflash_lightning.module import DFlashModule
from dflash_lightning.target_model import FeatureExtractor, TargetFeatures
from dflash_lightning.target_model.features import attention_for

QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40960, tie_word_embeddings=False,
)
MASK_ID = 151669
PROFILED = [torch.profiler.ProfilerActivity.CUDA]  # kernels only: CPU ops would count their kernels twice


DENSE_BF16_TFLOPS = {"NVIDIA H200": 989.4, "NVIDIA H100 80GB HBM3": 989.4}
"""Dense bf16 tensor-core peak by `torch.cuda.get_device_name()`, from the SXM datasheets (which print 1,979 TFLOP/s,
with 2:4 sparsity); a card not listed has no MFU, only its `matmul_fraction`."""


def utilisation(tflops: float, gpu: str, matmul_tflops: float) -> dict[str, float | None]:
    """MFU against the card's dense bf16 peak (None where `DENSE_BF16_TFLOPS` lacks the card) and the fraction of the
    matmul throughput measured on it."""
    peak = DENSE_BF16_TFLOPS.get(gpu)
    return {"mfu": tflops / peak if peak else None, "matmul_fraction": tflops / matmul_tflops}


def matmul_peak(n: int = 8192, iters: int = 20) -> float:
    """Measured bf16 dense matmul throughput in FLOP/s (random operands)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t)


def write_target(folder: Path, fields: dict = QWEN3_8B, final_norm: bool = False) -> Path:
    """A Qwen3-shaped target folder (`fields`: the config, Qwen3-8B's by default): config plus random embedding and
    head (all the module reads), and the final norm's weight (ones) with `final_norm` (a peer trainer reads it)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    Qwen3Config(**fields).save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    shape = (fields["vocab_size"], fields["hidden_size"])
    save_file(
        {"model.embed_tokens.weight": (torch.randn(shape, generator=g) * 0.02).bfloat16(),
         "lm_head.weight": (torch.randn(shape, generator=g) * 0.02).bfloat16(),
         **({"model.norm.weight": torch.ones(shape[1], dtype=torch.bfloat16)} if final_norm else {})},
        folder / "model.safetensors",
    )
    return folder


def random_batch(token_budget: int, max_documents: int, seed: int, vocab: int = MASK_ID,
                 doc_tokens: tuple[int, int] = (300, 3000)) -> dict[str, torch.Tensor]:
    """A packed row of chat-like documents (`doc_tokens` long, ~70% supervised), fixed shapes."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, doc, mask, lengths = [], [], [], [], []
    while len(lengths) < max_documents:
        n = int(torch.randint(*doc_tokens, (1,), generator=g))
        n = min(n, token_budget - sum(lengths))
        if n < 64:
            break
        prompt = n * 3 // 10
        ids.append(torch.randint(0, vocab, (n,), generator=g))
        pos.append(torch.arange(n))
        doc.append(torch.full((n,), len(lengths), dtype=torch.int32))
        mask.append(torch.arange(n) >= prompt)
        lengths.append(n)
    pad = token_budget - sum(lengths)
    ids.append(torch.zeros(pad, dtype=torch.long))
    pos.append(torch.arange(pad))
    doc.append(torch.full((pad,), -1, dtype=torch.int32))
    mask.append(torch.zeros(pad, dtype=torch.bool))
    doc_lengths = torch.zeros(max_documents, dtype=torch.int32)
    doc_lengths[: len(lengths)] = torch.tensor(lengths, dtype=torch.int32)
    return {"input_ids": torch.cat(ids), "position_ids": torch.cat(pos), "doc_ids": torch.cat(doc),
            "loss_mask": torch.cat(mask), "doc_lengths": doc_lengths}


class RandomData(LightningDataModule):
    """A fixed pool of random packed batches, served round-robin (the data path is benchmarked apart)."""

    def __init__(self, token_budget: int, max_documents: int = 64, pool: int = 8, steps: int = 100,
                 vocab: int = MASK_ID, doc_tokens: tuple[int, int] = (300, 3000)) -> None:
        super().__init__()
        self.batches = [random_batch(token_budget, max_documents, s, vocab, doc_tokens) for s in range(pool)]
        self.steps = steps

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            [self.batches[i % len(self.batches)] for i in range(self.steps)], batch_size=None, pin_memory=True
        )


class RandomFeatures(Callback):
    """Stands in for the target: fixed random context features (and final hidden states) already on the GPU."""

    def setup(self, trainer, pl_module, stage):
        cfg, T = pl_module.drafter_config, pl_module.hparams.token_budget
        self.features = torch.randn(T, cfg.num_context_layers * cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        self.final = torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        self.distills = pl_module.needs_final_hidden  # distillation, or a part that reads the target's logits

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch["context_features"] = self.features
        if self.distills:
            batch["final_hidden"] = self.final


class StepTimer(Callback):
    """Times the warm-up and the steady steps (synchronised at their ends only) and counts host syncs.

    Over the steady steps CUDA's sync debug mode turns every synchronising call (`.item()`, a
    device-to-host copy, ...) into a warning, charged to the step whose hooks were running.
    """

    def __init__(self, warmup: int, measured: int, profile_steps: int = 0) -> None:
        self.warmup, self.measured, self.profile_steps = warmup, measured, profile_steps
        self.first = self.steady = self.profile = None
        self.bounds: list[int] = []  # index into the warning records where each steady step began

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()
        if batch_idx == self.warmup:
            torch.cuda.synchronize()
            self.warmup_s = time.perf_counter() - self.t0
            self.frames = _compiled_frames()
            torch.cuda.reset_peak_memory_stats()
            self.catcher = warnings.catch_warnings(record=True)
            self.records = self.catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            self.t1 = time.perf_counter()
        if self.warmup <= batch_idx < self.warmup + self.measured:
            self.bounds.append(len(self.records))
        if batch_idx == self.warmup + self.measured and self.profile_steps:
            self.profiler = torch.profiler.profile(activities=PROFILED)
            self.profiler.__enter__()
            self.t2 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            torch.cuda.synchronize()
            self.first = time.perf_counter() - self.t0
        if batch_idx == self.warmup + self.measured - 1:
            torch.cuda.set_sync_debug_mode(0)  # before our own synchronize, which it would count
            self.catcher.__exit__(None, None, None)
            torch.cuda.synchronize()
            self.steady = (time.perf_counter() - self.t1) / self.measured
            self.recompiles = _compiled_frames() - self.frames
            self.peak_gb = torch.cuda.max_memory_allocated() / 1e9
            trainer.should_stop = not self.profile_steps
        if self.profile_steps and batch_idx == self.warmup + self.measured + self.profile_steps - 1:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.t2
            self.profiler.__exit__(None, None, None)
            self.profile = kernel_profile(self.profiler, wall, self.profile_steps)
            trainer.should_stop = True

    def host_syncs(self, metrics_every: int) -> dict:
        """Synchronising calls over the steady steps, on metric steps and on the others, with call sites."""
        ends = [*self.bounds[1:], len(self.records)]
        out = {"metric_steps": 0, "other_steps": 0, "sites": {}}
        for i, (begin, end) in enumerate(zip(self.bounds, ends, strict=True)):
            kind = "metric_steps" if (self.warmup + i) % metrics_every == 0 else "other_steps"
            for record in self.records[begin:end]:
                if "synchroniz" not in str(record.message):
                    continue
                out[kind] += 1
                site = f"{kind}: {Path(record.filename).name}:{record.lineno}"
                out["sites"][site] = out["sites"].get(site, 0) + 1
        return out


def kernel_profile(profiler: torch.profiler.profile, wall_s: float, steps: int) -> dict:
    """GPU time per step by kernel family, GPU busy fraction, and the heaviest kernels."""
    families = {"matmul": ("gemm", "nvjet", "cutlass", "sm90", "sm100", "xmma", "cublas"),
                "flex_attention": ("flex", "tem_fused"), "triton_fused": ("triton_",), "copy": ("memcpy", "memset")}
    per_family: dict[str, float] = {}
    kernels = []
    for event in profiler.key_averages():
        us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if us <= 0:
            continue
        name = event.key.lower()
        family = next((f for f, keys in families.items() if any(k in name for k in keys)), "other")
        per_family[family] = per_family.get(family, 0.0) + us / 1e3 / steps
        kernels.append((us / 1e3 / steps, event.key[:90]))
    busy = sum(per_family.values()) / 1e3 / (wall_s / steps)
    top = [{"ms_per_step": round(ms, 2), "kernel": k} for ms, k in sorted(kernels, reverse=True)[:15]]
    return {"gpu_ms_per_step": {k: round(v, 1) for k, v in sorted(per_family.items())},
            "wall_ms_per_step": round(wall_s / steps * 1e3, 1), "gpu_busy_fraction": round(busy, 3), "top_kernels": top}


def compile_breakdown(top: int = 12) -> dict[str, float]:
    """Seconds spent in the heaviest compiler phases so far (torch._dynamo's own timers, summed)."""
    from torch._dynamo.utils import compilation_time_metrics

    sums = {k: sum(v) for k, v in compilation_time_metrics.items()}
    return {k: round(v, 1) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:top]}


def _compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["frames"].values()))


def _recompiles() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["recompiles"].values()))


def write_result(result: dict, out: Path | None) -> None:
    """The results printed as indented JSON, and written to `out` when given."""
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def print_line(row: dict) -> None:
    print(json.dumps(row), flush=True)


class StepLog(Callback):
    """One line per step as it ends: host seconds since the last step ended, frames compiled and recompiled so far.

    No device sync: a step that compiles or autotunes shows at once; steady steps show the host's queueing pace.
    """

    def __init__(self, run: str, emit: Callable[[dict], None] = print_line) -> None:
        self.run, self.emit, self.rows = run, emit, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        row = {"run": self.run, "step": batch_idx, "host_s": round(now - self.last, 3),
               "compiled_frames": _compiled_frames(), "recompiles": _recompiles()}
        self.last = now
        self.rows.append(row)
        self.emit(row)


def compiler_settings() -> dict:
    """The process-wide settings a library could change behind a run's back (torchao's quantize_ once did)."""
    import torch._inductor.config as inductor

    names = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions", "max_autotune",
             "max_autotune_gemm", "max_autotune_pointwise", "force_fuse_int_mm_with_mul")
    return {**{name: getattr(inductor, name) for name in names},
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "recompile_limit": getattr(torch._dynamo.config, "recompile_limit", None)}


class StageTimeout(Exception):
    """A benchmark part ran past `--stage-timeout`; carries the main thread's stack at that moment."""


def stage_timeout_in(err: BaseException | None) -> StageTimeout | None:
    """The `StageTimeout` that `err` is or was raised from (torch's compiler wraps errors raised inside it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, StageTimeout):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def within(seconds: int, fn: Callable, *a, **kw):
    """`fn(*a, **kw)`, interrupted after `seconds` (0: never) by a `StageTimeout` holding the stack it was in."""
    if not seconds:
        return fn(*a, **kw)

    def expire(_signum, frame):
        import traceback

        stack = "".join(traceback.format_stack(frame)[-25:])
        raise StageTimeout(f"not done after {seconds} s; innermost frames then:\n{stack}")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        return fn(*a, **kw)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def step_flops(module: DFlashModule, batch: dict[str, torch.Tensor]) -> float:
    """Model FLOPs of one training step on `batch` (see the module docstring)."""
    cfg, hp = module.drafter_config, module.hparams
    T, A, B = hp.token_budget, hp.num_anchors, cfg.block_size
    H, mlp, V, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    N = A * B
    per_layer = N * H * hq * d * 2 + (N + T) * H * hkv * d * 2 + 3 * N * H * mlp
    linear = 6 * (cfg.num_layers * per_layer + T * cfg.num_context_layers * H * H)
    attention = 12 * d * hq * visible_pairs(cfg, batch, A)
    head = (6 if module.loss_settings.distills else 4) * A * (B - 1) * H * V  # slot 0 skips the head
    return float(linear + attention + head)


def visible_pairs(cfg: DrafterConfig, batch: dict[str, torch.Tensor], num_anchors: int) -> float:
    """Visible (query, key) pairs of one step summed over the drafter's layers, each under its own mask rule."""
    B = cfg.block_size
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], num_anchors, torch.Generator().manual_seed(0))
    starts = torch.cat([torch.zeros(1, dtype=torch.long), batch["doc_lengths"].long().cumsum(0)])
    doc = batch["doc_ids"][anchors].long().clamp(min=0)
    context = ((anchors - starts[doc]) * valid)[:, None]  # [A, 1] context positions strictly before each anchor
    slot = torch.arange(B)
    pairs = 0.0
    for layer in range(cfg.num_layers):
        window, causal = cfg.attention_rule(layer)
        seen = context if window is None else torch.minimum(context, (window - 1 - slot).clamp(min=0))  # [A, B]
        lo = (slot - window + 1).clamp(min=0) if window is not None else torch.zeros_like(slot)
        hi = slot + 1 if causal else ((slot + window).clamp(max=B) if window is not None else torch.full_like(slot, B))
        pairs += float((seen + (hi - lo)).expand(num_anchors, B).sum())
    return pairs


def drafter_shape(sliding_layers: int = 0, sliding_window: int = 2048, variant: str = "dflash") -> DrafterConfig:
    """The Qwen3-8B recipe's drafter (`variant` a preset of parts/presets.py); its first `sliding_layers` layers
    slide with window W (docs/method.md 3b)."""
    sliding = ["sliding_attention"] * sliding_layers + ["full_attention"] * (5 - sliding_layers)
    return DrafterConfig(num_layers=5, block_size=16, mask_token_id=MASK_ID, layer_types=sliding if sliding_layers
                         else None, sliding_window=sliding_window if sliding_layers else None, variant=variant)


def run_fit(target: Path, compile: bool, mode: str | None, warmup: int, measured: int, features: Callback,
            logs: Path, token_budget: int = 8192, anchors: int = 512, profile_steps: int = 0,
            drafter: DrafterConfig | None = None, doc_tokens: tuple[int, int] = (300, 3000),
            objective: str = "ce", loss_weights: str = "dpace",
            precision: str = "bf16-true", fp8: str = "none", fp8_recipe: str = "rowwise",
            data: LightningDataModule | None = None, extra: list[Callback] = (),
            progress: Callable[[dict], None] = print_line, name: str = "fit", seed: int = 0) -> dict:
    """One Trainer.fit (progress bar and CSV logger on, as users run it); timings, memory, recompiles, syncs.

    Each step's end is passed to `progress` as it happens (`StepLog`), with the compiler settings first.
    """
    from lightning.pytorch.loggers import CSVLogger

    torch._dynamo.reset()
    settings = compiler_settings()
    progress({"run": name, "compiler_settings": settings})
    log = StepLog(name, progress)
    torch.manual_seed(seed)  # the same initial drafter for every precision
    module = DFlashModule(
        str(target), drafter or drafter_shape(),
        token_budget=token_budget, num_anchors=anchors, compile=compile, compile_mode=mode, metrics_every=8,
        objective=objective, loss_weights=loss_weights, fp8=fp8, fp8_recipe=fp8_recipe,
    )
    timer = StepTimer(warmup, measured, profile_steps)
    data = data or RandomData(token_budget, steps=warmup + measured + profile_steps + 1, doc_tokens=doc_tokens)
    trainer = Trainer(
        accelerator="gpu", devices=1, precision=precision, max_steps=warmup + measured + profile_steps,
        logger=CSVLogger(logs), enable_checkpointing=False, gradient_clip_val=1.0, enable_model_summary=False,
        callbacks=[features, timer, log, *extra], log_every_n_steps=8,
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:  # a fit stopped inside the steady steps would leave these on for the next configuration
        torch.cuda.set_sync_debug_mode(0)
        if getattr(timer, "catcher", None) is not None and timer.steady is None:
            timer.catcher.__exit__(None, None, None)
    flops = step_flops(module, data.batches[0])
    N = anchors * module.drafter_config.block_size
    return {
        "compile": compile, "mode": mode, "objective": objective, "loss_weights": loss_weights,
        "precision": precision, "fp8": fp8, **({"fp8_recipe": fp8_recipe} if fp8 != "none" else {}),
        "first_step_s": timer.first, "warmup_steps": warmup,
        "warmup_s": timer.warmup_s, "compile_s": timer.warmup_s - warmup * timer.steady, "step_s": timer.steady,
        "draft_tokens_per_s": N / timer.steady, "context_tokens_per_s": token_budget / timer.steady,
        "tflop_per_step": flops / 1e12, "tflops": flops / timer.steady / 1e12, "peak_gb": timer.peak_gb,
        "recompiles_after_warmup": timer.recompiles, "host_syncs": timer.host_syncs(8),
        **({"profile": timer.profile} if timer.profile else {}),
        "compiler_settings": settings, "step_host_s": [row["host_s"] for row in log.rows[:warmup + 2]],
    }


def warm_cache_probe(target: Path, mode: str, warmup: int, shape_args: list[str]) -> dict:
    """The same compiled fit in a fresh process that finds the compiler caches the first run filled."""
    cmd = [sys.executable, __file__, "--probe-target", str(target), "--modes", mode, "--warmup", str(warmup),
           *shape_args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout)[-2000:]}
    return json.loads(lines[-1])


def target_rate(extractor: FeatureExtractor, token_budget: int, iters: int = 10,
                doc_tokens: tuple[int, int] = (300, 3000)) -> float:
    """Context tokens per second of the target's feature forward alone."""
    batch = {k: v.cuda() for k, v in random_batch(token_budget, 64, 0, doc_tokens=doc_tokens).items()}
    for _ in range(2):
        extractor(batch["input_ids"], batch["position_ids"])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        extractor(batch["input_ids"], batch["position_ids"])
    torch.cuda.synchronize()
    return token_budget * iters / (time.perf_counter() - t)


class ShiftedTokenFeatures(Callback):
    """A learnable stand-in for the target: features at t hold the embeddings of tokens t+1..t+K (loss curves).

    Random tokens alone leave nothing to learn; with these, slots 1..K-1 become predictable from the context.
    """

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ids, embed = batch["input_ids"], pl_module.drafter.embed_weight
        k = pl_module.drafter_config.num_context_layers
        scale = 1.0 / embed.float().std().item() if batch_idx == 0 else self.scale  # features of unit scale
        self.scale = scale
        batch["context_features"] = torch.cat([embed[ids.roll(-j)] for j in range(1, k + 1)], dim=-1) * scale


class LossCurve(Callback):
    """Every step's training loss, kept on the device until the fit ends (no host sync per step)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().float())

    def values(self) -> list[float]:
        return torch.stack(self.losses).cpu().tolist()


def curve_difference(curve: list[float], reference: list[float], tail: int = 50) -> dict:
    """Relative difference of a loss curve against a reference curve over the same batches."""
    a, b = torch.tensor(curve), torch.tensor(reference)
    rel = (a - b).abs() / b.abs()
    return {"mean_rel_diff": rel.mean().item(), "max_rel_diff": rel.max().item(),
            "mean_rel_diff_last": rel[-tail:].mean().item(), "final_loss": a[-tail:].mean().item(),
            "reference_final_loss": b[-tail:].mean().item()}


def feature_difference(fp8: torch.Tensor, reference: torch.Tensor, layers: int) -> list[float]:
    """||fp8 - bf16|| / ||bf16|| of each target layer's feature block  # [K]"""
    a, b = fp8.float().chunk(layers, dim=-1), reference.float().chunk(layers, dim=-1)
    return [((x - y).norm() / y.norm()).item() for x, y in zip(a, b, strict=True)]


def tiny_feature_difference(folder: Path, budget: int = 1024) -> dict:
    """FP8 vs bf16 features of the embedded tiny target (trained weights) on its own training conversations."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids, pos = [], []
    lines = (Path(folder).parents[0] / "data" / "train.jsonl").read_text().splitlines()
    for line in lines:
        row = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True)
        row = list(row["input_ids"] if hasattr(row, "keys") else row)  # a BatchEncoding in transformers 5
        if sum(map(len, ids)) + len(row) > budget:
            break
        ids.append(row)
        pos.append(list(range(len(row))))
    input_ids = torch.tensor(sum(ids, []), device="cuda")
    position_ids = torch.tensor(sum(pos, []), device="cuda")
    layer_ids = DFlashModule(str(folder)).drafter_config.target_layer_ids
    extractor = FeatureExtractor.from_pretrained(str(folder), layer_ids, torch.bfloat16, "cuda")
    reference = extractor(input_ids, position_ids)
    features = extractor.quantize_fp8()(input_ids, position_ids)
    return {"rel_diff_per_layer": feature_difference(features, reference, len(layer_ids)), "layers": layer_ids,
            "tokens": int(input_ids.numel()), "weights": "the embedded tiny target (trained)"}


def projection(tokens_per_s: float, gpus: int, efficiency: float, conversations: float, epochs: int,
               mean_tokens: float, fill: float, save_stall_s: float = 0.0, save_every_s: float | None = None) -> dict:
    """Hours to train a recipe on one node from the one-GPU rate (context tokens/s, pads included), plus the stall
    of a checkpoint save (`save_stall_s` every `save_every_s` seconds of training)."""
    real = tokens_per_s * fill * gpus * efficiency  # real tokens per second over the node
    training = conversations * epochs * mean_tokens / real / 3600
    stalls = training * save_stall_s / save_every_s if save_every_s else 0.0
    return {"gpus": gpus, "scaling_efficiency": efficiency, "conversations": conversations, "epochs": epochs,
            "mean_conversation_tokens": mean_tokens, "packing_fill": fill, "one_gpu_tokens_per_s": tokens_per_s,
            "node_real_tokens_per_s": real, "samples_per_s": real / mean_tokens, "save_stall_s": save_stall_s,
            "save_every_s": save_every_s, "training_hours": training, "checkpoint_hours": stalls,
            "hours": training + stalls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--modes", default="default", help="comma list of compile modes to measure")
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--pipeline-steps", type=int, default=200, help="measured steps of the co-located pipeline")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to skip: step,eager,pipeline,pipeline_fit,warm,profile,curves,"
                             "tiny_features,fp8_target")
    # Precision and FP8 (issues 14 and 17): each measured against bf16 in the same run.
    parser.add_argument("--precisions", default="bf16-true,bf16-mixed", help="drafter step precisions (compiled)")
    parser.add_argument("--fp8", default="head:rowwise,all:rowwise,all:tensorwise",
                        help="comma list of model.fp8:model.fp8_recipe measured under bf16-mixed")
    parser.add_argument("--curves", default="bf16-true,bf16-mixed,head:rowwise,all:tensorwise",
                        help="loss curves on the same batches: precisions, or FP8 modes under bf16-mixed")
    parser.add_argument("--curve-seeds", default="0", help="comma list of initial-drafter seeds of each curve")
    parser.add_argument("--curve-steps", type=int, default=200, help="steps of each loss curve")
    parser.add_argument("--pipeline-fp8", default=None,
                        help="model.fp8:model.fp8_recipe of the FP8 pipeline's drafter; default: the fastest FP8 step")
    parser.add_argument("--pipeline-targets", default="bf16,fp8", help="target precisions of the pipelines")
    parser.add_argument("--pipeline-pairs", default="matched", choices=("matched", "all"),
                        help="matched: bf16 drafter with bf16 target, FP8 with FP8; all: every drafter with every "
                             "target (the GPU configs train an FP8 drafter on a bf16 target)")
    parser.add_argument("--recipe-shape", default="3072,512", help="token budget,anchors of configs/qwen3-8b.yaml")
    parser.add_argument("--mean-tokens", type=float, default=1000, help="mean conversation length (projection)")
    parser.add_argument("--packing-fill", type=float, default=0.95, help="real tokens per budget token (projection)")
    parser.add_argument("--ddp-efficiency", type=float, default=ddp_efficiency(),
                        help=f"2-GPU DDP scaling (projection; default: the one of {SCALING_RESULT.name})")
    parser.add_argument("--token-budget", type=int, default=8192, help="tokens per packed row T")
    parser.add_argument("--anchors", type=int, default=512, help="anchors (blocks) per step A")
    parser.add_argument("--sliding-layers", type=int, default=0, help="drafter layers (of 5, first) that slide")
    parser.add_argument("--sliding-window", type=int, default=2048, help="window W of the sliding layers")
    parser.add_argument("--doc-tokens", default="300,3000", help="lo,hi: random documents' length range")
    parser.add_argument("--target-compile", action="store_true", help="compile the pipeline target's layers")
    parser.add_argument("--target-attention", default="auto", help="attention of the pipeline's target (auto, sdpa)")
    parser.add_argument("--variant", default="dflash", choices=list(VARIANTS), help="the drafter's variant")
    parser.add_argument("--objective", default="ce", choices=["ce", "kl", "ce+kl"], help="model.objective")
    parser.add_argument("--loss-weights", default="dpace", choices=["decay", "dpace"], help="model.loss_weights")
    parser.add_argument("--stage-timeout", type=int, default=0,
                        help="seconds after which one configuration is stopped and reported with its stack (0: none)")
    parser.add_argument("--probe-target", type=Path, default=None, help=argparse.SUPPRESS)  # warm-cache child
    args = parser.parse_args()
    recipe_kw = {"objective": args.objective, "loss_weights": args.loss_weights}
    torch.set_float32_matmul_precision("high")
    skip = set(args.skip.split(","))
    doc_tokens = tuple(int(n) for n in args.doc_tokens.split(","))
    shape_args = [f"--token-budget={args.token_budget}", f"--anchors={args.anchors}", f"--doc-tokens={args.doc_tokens}",
                  f"--sliding-layers={args.sliding_layers}", f"--sliding-window={args.sliding_window}",
                  f"--objective={args.objective}", f"--loss-weights={args.loss_weights}"]
    shape = dict(token_budget=args.token_budget, anchors=args.anchors, doc_tokens=doc_tokens,
                 drafter=drafter_shape(args.sliding_layers, args.sliding_window, args.variant))
    if args.probe_target:
        with tempfile.TemporaryDirectory() as logs:
            mode = None if args.modes == "default" else args.modes
            run = run_fit(args.probe_target, True, mode, args.warmup, 10, RandomFeatures(), Path(logs), **shape,
                          **recipe_kw)
        print(json.dumps({k: run[k] for k in ("first_step_s", "warmup_s", "compile_s", "step_s")}))
        return
    # A fresh compiler cache unless one is given: the first compiled mode is measured cold.
    cache = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "inductor_cache": cache, "cpu_count": os.cpu_count(), "argv": sys.argv[1:],
              "shape": {"token_budget": args.token_budget, "anchors": args.anchors, "block": 16, "layers": 5,
                        "layer_types": shape["drafter"].layer_types, "sliding_window": shape["drafter"].sliding_window,
                        "doc_tokens": list(doc_tokens), "target_attention": args.target_attention, **QWEN3_8B},
              **recipe_kw, "compiler_settings": compiler_settings()}
    try:
        import torchao

        result["torchao"] = torchao.__version__
    except ImportError:
        result["torchao"] = None
    peak = matmul_peak()
    result["bf16_matmul_peak_tflops"] = peak / 1e12
    result["bf16_dense_peak_tflops"] = DENSE_BF16_TFLOPS.get(result["gpu"])
    out = Path(os.environ["OUT"], "bench.json") if os.environ.get("OUT") else None

    written = [0.0]  # when the partial results were last written

    def report(key: str, value, line: dict | None = None, every_s: float = 0.0) -> None:
        result[key] = value
        print_line({key: value} if line is None else line)
        if out and time.monotonic() - written[0] >= every_s:  # partial results survive a time limit
            out.write_text(json.dumps(result, indent=2) + "\n")
            written[0] = time.monotonic()

    def progress(row: dict) -> None:
        """A fit's latest step line (and its compiler settings), printed; kept in the partial results every 5 s,
        so the timed steps do not rewrite the whole file each."""
        runs = result.get("progress", {})
        report("progress", {**runs, row["run"]: {**runs.get(row["run"], {}), **row}}, line=row, every_s=5.0)

    def attempt(fn, *a, **kw) -> dict:
        """A configuration that fails, or runs past --stage-timeout, is reported, not fatal."""
        try:
            return within(args.stage_timeout, fn, *a, **kw)
        except Exception as err:
            import traceback

            if timeout := stage_timeout_in(err):  # the compiler may have wrapped it
                return {"error": f"StageTimeout: {timeout}"[:6000]}
            return {"error": f"{type(err).__name__}: {err}"[:2000], "trace": traceback.format_exc()[-3000:]}

    with tempfile.TemporaryDirectory() as tmp:
        target = write_target(Path(tmp) / "target")
        logs = Path(tmp) / "logs"
        runs = {}
        # Compiled drafter step: each compile mode (bf16-true), then each precision and FP8 mode (default mode).
        configs = [(m, "bf16-true", "none", "rowwise") for m in args.modes.split(",") if m]
        configs += [("default", p, "none", "rowwise") for p in args.precisions.split(",") if p and p != "bf16-true"]
        configs += [("default", "bf16-mixed", *f.split(":")) for f in args.fp8.split(",") if f]
        for i, (mode, precision, fp8, recipe) in enumerate(configs if "step" not in skip else []):
            name = f"compiled[{mode}]" + (f"[{precision}]" if precision != "bf16-true" else "")
            name += f"[fp8={fp8},{recipe}]" if fp8 != "none" else ""
            profile = 3 if (i == 0 or fp8 != "none") and "profile" not in skip else 0
            runs[name] = attempt(run_fit, target, True, None if mode == "default" else mode, args.warmup, args.steps,
                                 RandomFeatures(), logs, profile_steps=profile, precision=precision, fp8=fp8,
                                 fp8_recipe=recipe, **shape, **recipe_kw, progress=progress, name=name)
            if "tflops" in runs[name]:
                runs[name] |= utilisation(runs[name]["tflops"], result["gpu"], peak / 1e12)
            if i == 0:
                runs[name]["compile_breakdown_s"] = compile_breakdown()
                if "warm" not in skip and (precision, fp8) == ("bf16-true", "none"):  # what the probe's child runs
                    runs[name]["warm_cache"] = warm_cache_probe(target, mode, args.warmup, shape_args)
            report("drafter_step", runs)
        if "eager" not in skip:
            runs["eager"] = run_fit(target, False, None, 3, 10, RandomFeatures(), logs, **shape, **recipe_kw)
            runs["eager"] |= utilisation(runs["eager"]["tflops"], result["gpu"], peak / 1e12)
            report("drafter_step", runs)
        ok = [r for r in runs.values() if "step_s" in r and r["compile"]]
        mixed = [r for r in ok if r["precision"] == "bf16-mixed" and r["fp8"] == "none"]
        if mixed:
            base = mixed[0]["step_s"]
            report("speedup_vs_bf16_mixed", {n: base / r["step_s"] for n, r in runs.items() if "step_s" in r})
        fp8_runs = [r for r in ok if r["fp8"] != "none"]
        best_fp8 = min(fp8_runs, key=lambda r: r["step_s"]) if fp8_runs else None

        if "tiny_features" not in skip:
            tiny = Path(__file__).resolve().parents[1] / "dflash_lightning/assets/tiny/target_model"
            report("fp8_target_feature_difference_tiny", attempt(tiny_feature_difference, tiny))
        if args.curve_steps and "curves" not in skip:
            # The same batches and anchors (seeded) in every mode: the curves differ by precision alone.
            curves, references, data = {}, {}, lambda: RandomData(8192, pool=32, steps=args.curve_steps + 1)
            modes = [("bf16-mixed", *c.split(":")) if ":" in c else (c, "none", "rowwise")
                     for c in args.curves.split(",")]
            seeds = [int(v) for v in args.curve_seeds.split(",")]
            for (precision, fp8, recipe), seed in itertools.product(modes, seeds):
                curve = LossCurve()
                suffix = f" seed {seed}" if seed else ""
                name = precision + (f"[fp8={fp8},{recipe}]" if fp8 != "none" else "") + suffix
                references[name] = "bf16-mixed" + suffix  # the reference of its seed
                run = attempt(run_fit, target, True, None, 8, args.curve_steps - 8, ShiftedTokenFeatures(), logs,
                              precision=precision, fp8=fp8, fp8_recipe=recipe, data=data(), extra=[curve],
                              **recipe_kw, progress=progress, name=f"curve {name}", seed=seed)
                curves[name] = run if "error" in run else {"loss": curve.values(), "step_s": run["step_s"]}
                report("loss_curves_partial", {n: c["loss"][::5] if "loss" in c else c for n, c in curves.items()})
            summary = {}  # each curve against bf16-mixed of its own seed (the seeds' spread is bf16-mixed's own)
            for n, c in curves.items():
                ref = curves.get(references[n], {}).get("loss")
                if ref and "loss" in c:
                    summary[n] = curve_difference(c["loss"], ref)
            report("loss_curves", {"steps": args.curve_steps, "vs_bf16_mixed": summary,
                                   "curves_every_5": {n: c.get("loss", c)[::5] if "loss" in c else c
                                                      for n, c in curves.items()}})

        if "pipeline" not in skip:
            from transformers import AutoModel, Qwen3Config

            torch.manual_seed(0)
            distills = args.objective != "ce"  # distillation runs the whole target for its final hidden states
            cfg = Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": 36 if distills else 34})  # else past 33: unused
            attention = attention_for(args.target_attention, torch.device("cuda"))  # auto: no [T, T] mask
            with torch.device("cuda"):
                model = AutoModel.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attention)
            extractor = FeatureExtractor(model, [1, 9, 17, 25, 33], 36, final_hidden=distills).cuda()
            if args.target_compile:  # a layer compiled before quantize_fp8 recompiles at its first FP8 call
                extractor.compile_layers()
            recipe_budget, recipe_anchors = (int(v) for v in args.recipe_shape.split(","))
            shapes = list(dict.fromkeys([(args.token_budget, args.anchors), (recipe_budget, recipe_anchors)]))
            if args.pipeline_fp8:
                best_fp8 = dict(zip(("fp8", "fp8_recipe"), args.pipeline_fp8.split(":"), strict=True))
            drafter_modes = [("bf16", "none", "rowwise")]
            if best_fp8 and "pipeline_fit" not in skip:
                drafter_modes.append(("fp8", best_fp8["fp8"], best_fp8["fp8_recipe"]))
            sample = {k: v.cuda() for k, v in random_batch(8192, 64, 0).items()}
            pipelines, reference = {}, extractor(sample["input_ids"], sample["position_ids"])

            def pipeline(budget: int, anchors: int, fp8: str, recipe: str, name: str) -> dict:
                t_rate = target_rate(extractor, budget, doc_tokens=doc_tokens)
                progress({"run": name, "target_tokens_per_s": t_rate})  # before the fit, which may not finish
                if "pipeline_fit" in skip:  # the target's rate alone
                    return {"token_budget": budget, "target_tokens_per_s": t_rate}
                callback = TargetFeatures(str(target))
                callback.extractor = extractor
                steps = args.warmup + args.pipeline_steps + 1
                pipe = run_fit(target, True, None, args.warmup, args.pipeline_steps, callback, logs,
                               **{**shape, "token_budget": budget, "anchors": anchors}, **recipe_kw,
                               precision="bf16-mixed", fp8=fp8, fp8_recipe=recipe,
                               data=RandomData(budget, steps=steps, doc_tokens=doc_tokens), progress=progress,
                               name=name)
                return {"token_budget": budget, "anchors": anchors, "drafter_fp8": fp8, "target_tokens_per_s": t_rate,
                        "pipeline_tokens_per_s": pipe["context_tokens_per_s"], "step_s": pipe["step_s"],
                        "peak_gb": pipe["peak_gb"], "recompiles_after_warmup": pipe["recompiles_after_warmup"],
                        "host_syncs": pipe["host_syncs"], "steps": args.warmup + args.pipeline_steps}

            kinds = [k for k in args.pipeline_targets.split(",") if k == "bf16" or "fp8_target" not in skip]
            for target_kind in kinds:
                if target_kind == "fp8":
                    extractor.quantize_fp8()
                    features = extractor(sample["input_ids"], sample["position_ids"])
                    report("compiler_settings_after_fp8_target", compiler_settings())
                    report("fp8_target_feature_difference", {
                        "rel_diff_per_layer": feature_difference(features, reference, 5), "layers": [1, 9, 17, 25, 33],
                        "weights": "random (Qwen3-8B shape)"})
                for budget, anchors in shapes:
                    for kind, fp8, recipe in drafter_modes:
                        if ("pipeline_fit" not in skip and args.pipeline_pairs == "matched"
                                and (target_kind == "fp8") != (kind == "fp8")):
                            continue  # bf16 drafter with bf16 target; FP8 drafter with FP8 target
                        name = f"{budget}/{anchors}[target={target_kind},drafter={kind}]"
                        pipelines[name] = attempt(pipeline, budget, anchors, fp8, recipe, name)
                        report("colocated_pipeline", pipelines)
            for kind in ("bf16", "fp8"):
                row = pipelines.get(f"{recipe_budget}/{recipe_anchors}[target={kind},drafter={kind}]", {})
                if "pipeline_tokens_per_s" in row:
                    result.setdefault("projection_8xh200", {})[kind] = projection(
                        row["pipeline_tokens_per_s"], 8, args.ddp_efficiency, 800e3, 6, args.mean_tokens,
                        args.packing_fill)
            report("projection_8xh200", result.get("projection_8xh200"))
    write_result(result, args.out)


if __name__ == "__main__":
    main()
