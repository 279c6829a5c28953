#!/usr/bin/env bash
# The vLLM 0.34.0 and speculators 0.9.0 files the engine tests run, taken from their wheels without installing either:
# vLLM 0.34's own DFlash, DFlash2, LiLiCorr, DSpark and XPress model modules (and XPress's Triton kernels), which
# tests/vllm034.py imports into the engine venv's vLLM 0.32 for the CPU (no 0.34 build for the CPU exists), and
# speculators' XPress refiner. The list is tests/vllm034.py's FILES.
#   bash tools/vllm_engine_files.sh DIR         (tools/engine_venv.sh runs it with DIR = VENV/vllm-0.34)
# Downloads 239 MB (the vLLM wheel, kept nowhere) and keeps 11 files (about 300 KB).
set -Eeuo pipefail
DIR=$1
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip download -q --no-deps vllm==0.34.0 speculators==0.9.0 -d "$TMP"
rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" - "$TMP" "$DIR" "$(dirname "$0")/../tests" <<'PYEOF'
import glob
import sys
import zipfile

tmp, out, tests = sys.argv[1:]
sys.path.insert(0, tests)
import vllm034  # noqa: E402 (the standard library only, at import)

for wheel, members in {"vllm-0.34.0": vllm034.FILES, "speculators-0.9.0": vllm034.SPECULATORS_FILES}.items():
    (path,) = glob.glob(f"{tmp}/{wheel}-*.whl")
    with zipfile.ZipFile(path) as z:
        for member in members:
            z.extract(member, out)
print(f"vLLM 0.34 and speculators 0.9 files in {out}: {len(vllm034.FILES) + len(vllm034.SPECULATORS_FILES)}")
PYEOF
