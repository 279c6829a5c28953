#!/usr/bin/env bash
# A venv with SGLang 0.5.23's Python code on the CPU torch, for the engine checks that run SGLang's own modules
# (tests/domino_engines.py), not a server: SGLang has no CPU build of its kernels here.
#   bash tools/sglang_venv.sh [VENV]            (default /tmp/sglang-venv)
# then `DFLASH_SGLANG_PYTHON=VENV/bin/python python -m pytest tests/test_domino.py -k sglang`.
# SGLang is installed without its dependencies (they pin CUDA builds: torch 2.14.1, flashinfer, cutlass, ...);
# the packages below are the ones its import chain to models/dflash.py and speculative/domino_utils.py reaches,
# at the versions its wheel pins where it pins one. Its own venv: SGLang 0.5.23 pins transformers 5.19.0, the
# project requires >= 5.24.
set -Eeuo pipefail
VENV=${1:-/tmp/sglang-venv}
SGLANG=0.5.23
TORCH=2.13.0

python3 -m venv --clear "$VENV"
PY=$VENV/bin/python
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==$TORCH"        # the CPU build these machines install for torch==2.13.0
# triton: torch's own flop counter and SGLang's kernels import it (a stand-in breaks torch); the rest: imports
# along SGLang's path to its DFlash model, its config parsing and its runtime context
"$PY" -m pip install -q "transformers==5.19.0" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" "openai==2.8.0" \
    "apache-tvm-ffi==0.1.11" orjson IPython gguf pybase64 triton pillow starlette msgspec pyzmq aiohttp dill \
    partial_json_parser einops "torch==$TORCH"
"$PY" -m pip install -q --no-deps "sglang==$SGLANG"
# The check the test makes too: SGLang's DFlash model and Domino rollout import (tests/domino_engines.py says why
# it needs the environment variable and two stand-ins)
cd "$(dirname "$0")/../tests"
SGLANG_USE_CPU_ENGINE=1 "$PY" -c 'import sys, domino_engines
domino_engines.prepare()
import sglang, torch, transformers
from sglang.srt.models.dflash import DFlashDraftModel
from sglang.srt.speculative.domino_utils import domino_greedy_rollout
print(f"sglang venv {sys.prefix}: sglang {sglang.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'
