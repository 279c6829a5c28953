"""The user's own `fit` command at the Qwen3-8B recipe shape on one GPU: steady step time and context tokens/s.

Builds a random Qwen3-8B-shaped target (34 layers of weights, the 36-layer config; no download), a byte-level BPE
tokenizer in its folder and synthetic conversations of log-normal lengths (median 700 tokens, as data_bench.py),
then runs `python -m dflash_lightning fit --config CONFIG` with only the target, data, step count and output folder
overridden, plus `StepTimer` (this file) as one more callback. Reproduce on an H200 with:

    python benchmarks/fit_bench.py --config configs/qwen3-8b-dflash2.yaml --out X.json
    python benchmarks/fit_bench.py --config configs/qwen3-8b.yaml --out Y.json -- --model.fp8=none --target.fp8=false

Saves and preemption, one run: `--steps 80 --after 100 --save-every 100 --sigterm-at 190` times every step after the
warm-up (CUDA events, no sync), so the 80 steps without a save give the steady step and the save at step 100 the
seconds it cost the steps after it (its stall and the background write's share of the CPU); SIGTERM at step 190
times the preemption save from the signal to the saved checkpoint and to the exit; the fit's own checkpoint lines
and the checkpoints' sizes are kept (`--clean` then deletes the checkpoints).

Arguments after `--` go to `fit` unchanged.
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
TIMER_OUT = "FIT_BENCH_TIMER_OUT"  # where StepTimer writes its figures (set by this script for the child)
TEARDOWN_STACKS = "FIT_BENCH_TEARDOWN_STACKS"  # seconds: after a preemption, print every thread's stack this often


class StepTimer(Callback):
    """Seconds per step over steps [warmup, warmup + steps), synchronised at both ends only; peak memory; then, with
    `profile` > 0, a torch.profiler table of the next `profile` steps (outside the timed window); written as JSON.

    Also each step's end after the warm-up as a CUDA event (no sync; read at the end of the run, preempted or not),
    and with `sigterm_at` > 0 a SIGTERM to this process at that step's end (the user's preemption)."""

    def __init__(self, warmup: int = 20, steps: int = 60, profile: int = 0, sigterm_at: int = 0) -> None:
        self.warmup, self.window, self.profile, self.sigterm_at = warmup, steps, profile, sigterm_at
        self.t0, self.start, self.first_step_s, self.result, self.prof = None, time.perf_counter(), None, None, None
        self.marks: list = []  # (step, CUDA event or perf_counter seconds) from the warm-up's end on
        self.extra: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.start
        if step >= self.warmup:
            self.marks.append((step, _mark()))
        if step == self.sigterm_at:
            self.extra |= {"sigterm_at_step": step, "sigterm_sent_unix": time.time()}
            self._write()
            os.kill(os.getpid(), signal.SIGTERM)  # Preemption saves at the next step's end and exits
        if step == self.warmup:
            _sync()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()
        elif step == self.warmup + self.window and self.t0 is not None:
            _sync()
            seconds = (time.perf_counter() - self.t0) / self.window
            budget = trainer.datamodule.hparams.token_budget
            saves = [n for cb in trainer.checkpoint_callbacks if (n := getattr(cb, "_every_n_train_steps", 0))]
            self.result = {
                "step_s": seconds, "context_tokens_per_s": budget / seconds, "token_budget": budget,
                "packing": trainer.datamodule.packing_stats(), "save_every_n_train_steps": min(saves, default=None),
                "measured_steps": self.window,
                "warmup_steps": self.warmup, "first_step_after_s": self.first_step_s,
                "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
            }
            self._write()
            if self.profile:
                self.prof = torch.profiler.profile(activities=_activities())
                self.prof.__enter__()
                self.t0 = time.perf_counter()
        elif self.prof is not None and step == self.warmup + self.window + self.profile:
            _sync()
            wall = (time.perf_counter() - self.t0) / self.profile
            self.prof.__exit__(None, None, None)
            self.result["profile"] = profile_summary(self.prof, self.profile, wall)
            self.prof = None
            self._write()

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.extra["exception_unix"] = time.time()  # a preempted run: its save is complete here
        self._finish()  # its steps still counted
        if os.environ.get(TEARDOWN_STACKS):  # where the exit spends its time: the stacks every N seconds
            faulthandler.dump_traceback_later(float(os.environ[TEARDOWN_STACKS]), repeat=True)

    def _finish(self) -> None:
        _sync()
        pairs = list(itertools.pairwise(self.marks))
        self.extra["step_s_each"] = {"first_step": pairs[0][1][0] if pairs else None,
                                     "seconds": [_elapsed(a, b) for (_, a), (_, b) in pairs]}
        self._write()

    def _write(self) -> None:
        Path(os.environ[TIMER_OUT]).write_text(json.dumps({**(self.result or {}), **self.extra}))


def _mark():
    if torch.cuda.is_available():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed(a, b) -> float:
    return a.elapsed_time(b) / 1e3 if torch.cuda.is_available() else b - a


def save_windows(seconds: list[float], first_step: int, every: int, baseline_steps: int) -> dict:
    """Steps without a save against the steps after each save. `seconds[j]` is step `first_step + j`; a save at
    step s (a multiple of `every`) runs after step s's end, so it falls in step s + 1. The steady step is the mean
    of the first `baseline_steps`, which must hold no save; per save, the seconds its window (up to the next save,
    or the end) took beyond as many steady steps."""
    last = first_step + len(seconds) - 1
    saves = [s for s in range(first_step - 1, last) if s % every == 0]
    if baseline_steps < 1 or any(s + 1 < first_step + baseline_steps for s in saves):
        raise ValueError(f"the {baseline_steps} steps from {first_step} hold a save (every {every}): no baseline")
    steady = statistics.fmean(seconds[:baseline_steps])
    windows = []
    for i, save in enumerate(saves):
        stop = saves[i + 1] + 1 if i + 1 < len(saves) else last + 1
        part = seconds[save + 1 - first_step:stop - first_step]
        windows.append({"save_step": save, "steps": len(part), "mean_step_s": statistics.fmean(part),
                        "max_step_s": max(part), "excess_s": sum(part) - steady * len(part)})
    return {"no_save": {"steps": baseline_steps, "mean_step_s": steady,
                        "median_step_s": statistics.median(seconds[:baseline_steps])}, "with_save": windows}


CHECKPOINT_LINES = re.compile(r"checkpoint|SIGTERM|stalled|reserved|grace_s", re.IGNORECASE)


def _activities() -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    return acts + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def profile_summary(prof, steps: int, wall_s: float, top: int = 25) -> dict:
    """Per step: the wall time, the device's busy time (its kernels, summed), the top kernels and the top host ops."""
    events = [e for e in prof.key_averages() if e.key]
    host = {e.key for e in events if e.device_type != torch.autograd.DeviceType.CUDA}
    # kernels only: not the ops that launch them, nor the GPU side of a host annotation ("Optimizer.step#AdamW.step"
    # spans the optimizer's kernels, which are counted already)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in host]
    device = sum(e.self_device_time_total for e in kernels) / 1e6 / steps

    def rows(key: str) -> list[dict]:
        ranked = sorted(kernels if key == "self_device_time_total" else events, key=lambda e: getattr(e, key),
                        reverse=True)[:top]
        return [{"op": e.key[:90], "calls_per_step": e.count / steps, "device_ms": e.self_device_time_total / 1e3
                 / steps, "host_ms": e.self_cpu_time_total / 1e3 / steps} for e in ranked]

    return {"steps": steps, "wall_s_per_step": wall_s, "device_busy_s_per_step": device,
            "device_idle_fraction": max(0.0, 1 - device / wall_s) if torch.cuda.is_available() else None,
            "top_device": rows("self_device_time_total"),
            "top_host": rows("self_cpu_time_total")}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prepare(work: Path, docs: int, layers: int = 34) -> tuple[Path, Path]:
    """The random target folder (with its tokenizer; the weights of its first `layers` layers) and the conversations
    file, made once per folder."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.data_bench import make_tokenizer, write_conversations
    from benchmarks.scaling_bench import make_target

    target, data = work / ("target" if layers == 34 else f"target-{layers}"), work / "train.jsonl"
    if not (target / "config.json").exists():
        make_target(target, layers)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(6000)]
    if not data.exists():
        tokens_per_word = make_tokenizer(target, words, rng)
        write_conversations(data, docs, words, tokens_per_word, rng)
    return target, data


def edited_config(config: Path, run: Path, save_every: int, sync_saves: bool) -> Path:
    """A copy of the config in the run folder with the checkpoint interval set and/or background saves off."""
    import yaml

    data = yaml.safe_load(config.read_text())
    trainer = data["trainer"]
    if sync_saves:
        trainer["plugins"] = [p for p in trainer.get("plugins") or [] if "CheckpointIO" not in str(p)] or None
    for cb in trainer.get("callbacks") or []:
        if save_every and str(cb.get("class_path", "")).endswith("ModelCheckpoint"):
            cb.setdefault("init_args", {})["every_n_train_steps"] = save_every
    out = run / config.name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def _bytes(path: Path) -> int:
    """A checkpoint's size: a file, or a distributed checkpoint's folder; a link counts as 0 (it names another)."""
    if path.is_symlink():
        return 0
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/qwen3-8b.yaml")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fit-bench"), help="target, data and run folders")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timed window (compile, warm-up)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps")
    parser.add_argument("--profile", type=int, default=0, help="steps profiled after the timed window (0: none)")
    parser.add_argument("--save-every", type=int, default=0,
                        help="the config's ModelCheckpoint every_n_train_steps (0: as the config says)")
    parser.add_argument("--sync-saves", action="store_true", help="drop the config's background-save plugin")
    parser.add_argument("--after", type=int, default=0,
                        help="timed steps after the window (saves and the SIGTERM fall there; 0: none)")
    parser.add_argument("--sigterm-at", type=int, default=0, help="send SIGTERM at this step's end (0: never)")
    parser.add_argument("--clean", action="store_true",
                        help="delete the run's checkpoints once their sizes are recorded (12.6 GB each at the recipe)")
    parser.add_argument("--docs", type=int, default=3000, help="synthetic conversations")
    parser.add_argument("--target", type=Path, default=None, help="an existing target folder instead of a random one")
    parser.add_argument("--target-layers", type=int, default=34,
                        help="layers with weights in the random target: 34 feeds ids up to 33; 36, the whole target, "
                             "for a run that reads its final hidden state (distillation, LiLiCorr, DSpark)")
    parser.add_argument("--data", type=Path, default=None, help="its conversations (with --target)")
    parser.add_argument("fit_args", nargs="*", help="after --: more `fit` arguments")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    target, data = (
        (args.target.resolve(), args.data.resolve()) if args.target else prepare(work, args.docs, args.target_layers)
    )
    run = work / f"run-{Path(args.config).stem}-{int(time.time())}"
    run.mkdir()
    timer_out = run / "timer.json"
    config = (ROOT / args.config).resolve()
    if args.save_every or args.sync_saves:
        config = edited_config(config, run, args.save_every, args.sync_saves)
    command = [
        sys.executable, "-m", "dflash_lightning", "fit", "--config", str(config),
        f"--target.path={target}", f"--data.train_files=[{data}]", f"--data.val_files=[{data}]",
        f"--trainer.max_steps={args.warmup + args.steps + args.profile + args.after + 1}",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks+=" + json.dumps({"class_path": "benchmarks.fit_bench.StepTimer",
                                              "init_args": {"warmup": args.warmup, "steps": args.steps,
                                                            "profile": args.profile, "sigterm_at": args.sigterm_at}}),
        *args.fit_args,
    ]
    env = {**os.environ, TIMER_OUT: str(timer_out), "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    t = time.perf_counter()
    proc = subprocess.run(command, cwd=run, env=env, capture_output=True, text=True)
    exited = time.time()
    log = proc.stdout + proc.stderr
    (run / "fit.log").write_text(log)
    result = {"date": time.strftime("%Y-%m-%d"), "config": args.config, "fit_args": args.fit_args,
              "command": "python benchmarks/fit_bench.py " + " ".join(sys.argv[1:]), "exit_code": proc.returncode,
              "wall_s": time.perf_counter() - t, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
              else "cpu", "log": str(run / "fit.log")}
    if timer_out.exists():
        result |= json.loads(timer_out.read_text())
    if "step_s" not in result:
        result["log_tail"] = log[-4000:]
    if "sigterm_sent_unix" in result:
        result["signal_to_exit_s"] = exited - result["sigterm_sent_unix"]
        if "exception_unix" in result:  # the save done and Preempted raised; the rest is Lightning's and Python's exit
            result["signal_to_saved_s"] = result["exception_unix"] - result["sigterm_sent_unix"]
    result["checkpoint_lines"] = [line.strip() for line in log.splitlines() if CHECKPOINT_LINES.search(line)][:40]
    result["checkpoints"] = {str(p.relative_to(run)): _bytes(p) for p in sorted(run.rglob("*.ckpt"))}
    if args.clean:
        for path in sorted(run.rglob("*.ckpt"), key=lambda p: not p.is_symlink()):  # links first, then their files
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    each, every = result.get("step_s_each"), result.get("save_every_n_train_steps")
    if each and each["seconds"] and every:
        result["save_windows"] = save_windows(each["seconds"], each["first_step"], every, args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
