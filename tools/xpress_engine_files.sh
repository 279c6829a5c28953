#!/usr/bin/env bash
# The vLLM 0.34.0 and speculators 0.9.0 files the XPress engine test runs (tests/xpress_engines.py), taken from their
# wheels without installing either: the engine venv's vLLM 0.32 for the CPU has no XPress and no 0.34 build for the
# CPU exists, so the test puts these on the path of the engine venv's vLLM, in its own process.
#   bash tools/xpress_engine_files.sh [DIR]            (default /tmp/dflash-xpress-files)
# then
#   DFLASH_ENGINE_PYTHON=VENV/bin/python DFLASH_XPRESS_FILES=DIR python -m pytest tests/test_xpress.py -k engines
# Downloads 239 MB (the vLLM wheel, kept nowhere) and keeps 4 files (33 KB).
set -Eeuo pipefail
DIR=${1:-/tmp/dflash-xpress-files}
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip download -q --no-deps vllm==0.34.0 speculators==0.9.0 -d "$TMP"
rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" - "$TMP" "$DIR" <<'EOF'
import glob
import sys
import zipfile

tmp, out = sys.argv[1], sys.argv[2]
wanted = {
    "vllm-0.34.0": ["vllm/model_executor/models/qwen3_xpress.py", "vllm/v1/worker/gpu/spec_decode/xpress/__init__.py",
                    "vllm/v1/worker/gpu/spec_decode/xpress/kernels.py"],
    "speculators-0.9.0": ["speculators/models/xpress/model_definitions.py"],
}
for wheel, members in wanted.items():
    (path,) = glob.glob(f"{tmp}/{wheel}-*.whl")
    with zipfile.ZipFile(path) as z:
        for member in members:
            z.extract(member, out)
print(f"xpress engine files in {out}: " + ", ".join(m for ms in wanted.values() for m in ms))
EOF
