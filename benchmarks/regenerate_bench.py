"""Throughput of `regenerate`'s two backends on the embedded tiny target, on the CPU: in-process `generate` (hf) and
a local `transformers serve` through the OpenAI-compatible backend; prints one JSON object per backend.

    python benchmarks/regenerate_bench.py [--max-new-tokens 64] [--concurrency 16] [--continuous-batching]

The records are the tiny target's 74 held-out prompts (one turn each) plus, with --train N, the first N training
conversations (multi-turn ones among them). Both backends decode greedily with the same settings and their outputs
are compared line for line. The server is started here on 127.0.0.1 with the same thread count and stopped at the
end; its start-up is not timed (a real run's server is up before regenerate starts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

TINY = ROOT / "dflash_lightning" / "assets" / "tiny"


def records(folder: Path, train: int) -> Path:
    """A JSONL of the held-out prompts and the first `train` training conversations."""
    lines = (TINY / "data" / "prompts.jsonl").read_text().splitlines()
    lines += (TINY / "data" / "train.jsonl").read_text().splitlines()[:train]
    path = folder / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_server(threads: int, continuous_batching: bool, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(TINY / "target_model"), "--host",
           "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    cmd += ["--continuous-batching"] if continuous_batching else []
    with log.open("wb") as f:
        process = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return process, url + "/v1"
        except OSError:
            time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit(f"transformers serve did not come up:\n{log.read_text()[-3000:]}")


def timed(backend: str, out: Path, **kwargs) -> dict:
    """Runs regenerate once; its closing line's figures."""
    import dflash_lightning.regenerate.generate as rg

    printed = StringIO()
    began = time.perf_counter()
    with redirect_stdout(printed):
        rg.regenerate(out=str(out), backend=backend, progress=False, **kwargs)
    seconds = time.perf_counter() - began
    line = printed.getvalue().strip().splitlines()[-1]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    tokens = int(line.split(" tokens generated")[0].rsplit(" ", 1)[-1].replace(",", ""))
    return {"backend": backend, "records": len(rows), "seconds": round(seconds, 2), "tokens": tokens,
            "records_per_s": round(len(rows) / seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
            "summary": line}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--train", type=int, default=0, help="also the first N training conversations")
    parser.add_argument("--batch-size", type=int, default=32, help="hf: conversations per generate batch")
    parser.add_argument("--concurrency", type=int, default=16, help="openai: conversations in flight")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each backend")
    parser.add_argument("--continuous-batching", action="store_true", help="start the server with it")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    common = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "on_bad_record": "error"}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = records(folder, args.train)
        common["input_files"] = [str(source)]
        results.append(timed("hf", folder / "hf.jsonl", target=str(TINY / "target_model"), batch_size=args.batch_size,
                             device="cpu", dtype="float32", **common))
        process, url = start_server(args.threads, args.continuous_batching, folder / "serve.log")
        try:
            results.append(timed("openai", folder / "openai.jsonl", base_url=url, concurrency=args.concurrency,
                                 **common))
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        same = (folder / "hf.jsonl").read_bytes() == (folder / "openai.jsonl").read_bytes()
    report = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "load_average": os.getloadavg(), "torch": torch.__version__, "args": {k: str(v) for k, v in
                                                                                    vars(args).items()},
              "outputs_equal": same, "results": results}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
