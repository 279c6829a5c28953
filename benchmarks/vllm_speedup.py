"""The real speedup of an exported drafter: vLLM serving the target alone, then with the drafter, same prompts, greedy.

The checkpoint is exported (`python -m dflash_lightning export`) and served with the command `export` prints plus the
CPU flags; each server runs alone on the machine, one request at a time (the latency-bound case speculative decoding
is for). Reported per server: output tokens per second over the timed requests (a first, untimed request warms the
engine), and with the drafter vLLM's own acceptance counters (tau = 1 + accepted / drafts). The token ids of both
servers must be equal (greedy speculative decoding is lossless); a difference is reported and fails the run.

    python benchmarks/vllm_speedup.py --engine-python /tmp/dflash-engine-venv/bin/python \
        --checkpoint runs/smollm2-135m/checkpoints/last.ckpt --num-prompts 16 --max-tokens 128 --out X.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import vllm_engine as ve  # noqa: E402

PROMPTS = "dflash_lightning/assets/tiny/data/prompts.jsonl"


def export(checkpoint: str, folder: Path) -> tuple[str, list[str], str]:
    """`export` as a user runs it: the served model, the serve arguments and the printed command."""
    done = subprocess.run([sys.executable, "-m", "dflash_lightning", "export", "--checkpoint", checkpoint, "--out",
                           str(folder)], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"export failed:\n{done.stderr[-3000:]}")
    (command,) = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("vllm serve ")]
    argv = shlex.split(command)
    return argv[2], argv[3:], command


def run_server(server: ve.VllmServer, prompts: list[dict], max_tokens: int, counters: bool) -> dict:
    """Every prompt, one at a time, greedy: token ids, seconds and (with a drafter) vLLM's acceptance counters."""
    url = server.wait()

    def chat(messages: list[dict]) -> dict:
        body = {"model": server.model, "messages": messages, "return_token_ids": True, "temperature": 0.0,
                "max_tokens": max_tokens, "chat_template_kwargs": {"enable_thinking": False}}
        return ve.post_json(f"{url}/chat/completions", body)

    chat(prompts[0]["messages"])  # warm-up, untimed
    before = ve.spec_decode_counters(url) if counters else None
    answers, seconds = [], []
    for row in prompts:
        start = time.perf_counter()
        answers.append(chat(row["messages"])["choices"][0]["token_ids"])
        seconds.append(time.perf_counter() - start)
    out = {"tokens": sum(map(len, answers)), "seconds": round(sum(seconds), 2),
           "tokens_per_s": round(sum(map(len, answers)) / sum(seconds), 2), "answers": answers}
    if counters:
        after = ve.spec_decode_counters(url)
        diff = {k: (after[k] - before[k]) if k != "accepted_per_position" else
                [a - b for a, b in itertools.zip_longest(after[k], before[k], fillvalue=0)] for k in after}
        out["vllm"] = diff
        out["tau"] = round(1 + diff["accepted_tokens"] / max(diff["drafts"], 1), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", required=True, help="python of a venv made by tools/engine_venv.sh")
    parser.add_argument("--checkpoint", required=True, help="a fit's checkpoint (last.ckpt)")
    parser.add_argument("--prompts", default=PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vllm-speedup"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from dflash_lightning.decoding.evaluate import read_prompts

    prompts = read_prompts(args.prompts)[: args.num_prompts]
    args.work.mkdir(parents=True, exist_ok=True)
    model, serve_args, command = export(args.checkpoint, args.work / "drafter")
    flags = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(args.max_model_len)]
    engine = ve.engine_python(args.engine_python)
    runs = {}
    for name, extra in (("alone", []), ("drafter", serve_args)):
        with ve.VllmServer(engine, model, extra + flags, args.work / f"{name}.log", cwd=ROOT) as server:
            runs[name] = run_server(server, prompts, args.max_tokens, counters=bool(extra))
    equal = [a == b for a, b in zip(runs["alone"]["answers"], runs["drafter"]["answers"], strict=True)]
    versions = subprocess.run([str(engine), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                              capture_output=True, text=True)
    record = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core CPU", "engine": versions.stdout.strip(),
        "command": "python benchmarks/vllm_speedup.py " + " ".join(sys.argv[1:]), "checkpoint": args.checkpoint,
        "served_with": command + " " + " ".join(flags), "prompts": args.prompts, "num_prompts": len(prompts),
        "max_tokens": args.max_tokens, "outputs_equal": all(equal), "unequal_prompts": equal.count(False),
        "speedup": round(runs["drafter"]["tokens_per_s"] / runs["alone"]["tokens_per_s"], 3),
        **{name: {k: v for k, v in run.items() if k != "answers"} for name, run in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("alone", "drafter")}, indent=2))
    print(f"alone {runs['alone']['tokens_per_s']} tok/s, with the drafter {runs['drafter']['tokens_per_s']} tok/s "
          f"(tau {runs['drafter']['tau']}): {record['speedup']}x; outputs equal: {record['outputs_equal']}")
    if not all(equal):
        raise SystemExit(f"{equal.count(False)} of {len(equal)} answers differ between the two servers")


if __name__ == "__main__":
    main()
