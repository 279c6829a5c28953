#!/usr/bin/env bash
# This project's training step against the peers' own (issue 57, docs/peers.md), one variant a device call, on one
# H100 or H200, every process on the same card:
#   bash benchmarks/peers_gpu.sh OUT wheels     HERE (needs PyPI): the peers' wheels and the packages the GPU image
#                                               lacks, for its CPython 3.12, into .peers-wheels/ (git-ignored, ~25 MB:
#                                               one carry holds them all); prints the sizes and the carry argument
#   bash benchmarks/peers_gpu.sh OUT VARIANT    ON THE GPU (carry .peers-wheels): install them with pip --no-index
#                                               --no-deps --target, then ours (step_bench.py at 8192/512, compiled,
#                                               bf16-mixed, decay weights, as variants_h200.sh `step` without FP8) and
#                                               each peer's step (peers_step.py), one process each, JSON in OUT;
#                                               VARIANT: dflash dflash2 dspark domino xpress lilicorr-conv
#   bash benchmarks/peers_gpu.sh OUT collect    the table of step times and ratios from OUT's JSON files
#   bash benchmarks/peers_gpu.sh OUT smoke      HERE, on the CPU (needs PyPI): the same wheels for this Python, then
#                                               every peer's step at `--shape tiny` (about 9 minutes on 2 cores)
# PEERS picks the peers of a variant part (default: all three); WARMUP, STEPS and STEP_TIMEOUT (seconds a process).
set -u -o pipefail
out=${1:?OUT_DIR}; part=${2:?wheels|dflash|dflash2|dspark|domino|xpress|lilicorr-conv|collect|smoke}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
WHEELS=$repo/.peers-wheels; SITE=${SITE:-/tmp/peers-site}
export PYTHONPATH=$SITE:$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-peers}
PY=${PY:-python3}
# The peers (pinned) and what their training imports that the GPU image (KINDS.md's list) lacks; pydantic and
# pydantic-core as one pair, openai 2.x (speculators' train/data.py imports it; 3.x needs httpx2, not on the image)
# pydantic-core as one pair, openai 2.x (speculators' train/data.py imports it; 3.x needs httpx2, not on the image);
# ModelOpt's omegaconf needs antlr4-python3-runtime 4.9.x, a source archive only: `wheels` builds its wheel
PINNED="speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0 nvidia-modelopt==0.47.0 datasets==5.1.0 dill==0.4.0
  multiprocess==0.70.18 loguru==0.7.3 pydantic==2.12.5 pydantic-core==2.41.5 pydantic-settings==2.12.0
  python-dotenv==1.2.1 annotated-types==0.7.0 typing-inspection==0.4.2 openai==2.14.0 distro==1.9.0 jiter==0.12.0
  sniffio==1.3.1 omegaconf==2.4.0 pulp==3.3.2"
SOURCE_ONLY="antlr4-python3-runtime==4.9.3"
CPU_EXTRA="pandas xxhash httpx==0.28.1 httpcore==1.0.9 scipy nvidia-ml-py"  # on the GPU image, not in the CPU venv
# ModelOpt 0.47 builds transformers' Qwen3RotaryEmbedding(config, device=), which transformers 5.25 (the CPU venv)
# no longer takes: the CPU smoke runs ModelOpt on the GPU image's transformers 5.17 (with its huggingface-hub 1.x)
GPU_IMAGE_HF="transformers==5.17.0 huggingface-hub==1.33.0"
mkdir -p "$out"

peers_of() {  # the peers that train variant $1 (peers_step.py says why a pair cannot run)
  case $1 in
    dflash) echo speculators specforge modelopt ;; dflash2|xpress) echo speculators ;; dspark) echo speculators specforge modelopt ;;
    domino) echo specforge modelopt ;; lilicorr-conv) echo modelopt ;;
  esac
}

case $part in
  wheels)
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$WHEELS" $PINNED || exit 1
    $PY -m pip wheel --no-deps -w "$WHEELS" $SOURCE_ONLY || exit 1  # pure Python: any CPython
    du -ch "$WHEELS"/*.whl | tee "$out/wheels.txt"
    echo "carry: [\".peers-wheels\"]  (with the repository, about 43 MB of the 64 MiB a call carries)" | tee -a "$out/wheels.txt" ;;
  smoke)
    # shellcheck disable=SC2086
    $PY -m pip install -q --no-deps --target "$SITE" $PINNED $SOURCE_ONLY $CPU_EXTRA || exit 1
    $PY -m pip install -q --no-deps --target "$SITE-hf" $GPU_IMAGE_HF || exit 1
    for pair in speculators:dflash speculators:dflash2 speculators:dspark speculators:xpress specforge:dflash \
                specforge:dspark specforge:domino modelopt:dflash modelopt:dspark modelopt:domino; do
      path=$PYTHONPATH; [ "${pair%%:*}" = modelopt ] && path=$SITE-hf:$PYTHONPATH
      PYTHONPATH=$path timeout "${STEP_TIMEOUT:-600}" $PY benchmarks/peers_step.py --peer "${pair%%:*}" \
        --variant "${pair##*:}" --shape tiny --device cpu --warmup 2 --steps 2 --rows 2 \
        --out "$out/smoke-${pair/:/-}.json" > "$out/smoke-${pair/:/-}.log" 2>&1
      echo "smoke $pair: exit $?" | tee -a "$out/smoke.txt"
    done
    ! grep -v "exit 0" "$out/smoke.txt" ;;
  collect)
    $PY benchmarks/peers_step.py --collect "$out" ;;
  dflash|dflash2|dspark|domino|xpress|lilicorr-conv)
    ls "$WHEELS"/*.whl > /dev/null || { echo "no $WHEELS: run the wheels part here, then carry .peers-wheels"; exit 1; }
    $PY -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl > "$out/install.log" 2>&1 || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/card-$part.txt"
    timeout "${STEP_TIMEOUT:-300}" $PY benchmarks/step_bench.py --variant "$part" --modes "" --precisions bf16-mixed \
      --fp8 "" --loss-weights decay --skip eager,warm,curves,tiny_features,pipeline,profile \
      --warmup "${WARMUP:-12}" --steps "${STEPS:-30}" --out "$out/ours-$part.json" > "$out/ours-$part.log" 2>&1
    echo "ours $part: exit $?" | tee -a "$out/runs.txt"
    for peer in ${PEERS:-$(peers_of "$part")}; do
      timeout "${STEP_TIMEOUT:-300}" $PY benchmarks/peers_step.py --peer "$peer" --variant "$part" \
        --warmup "${WARMUP:-12}" --steps "${STEPS:-30}" --out "$out/$peer-$part.json" > "$out/$peer-$part.log" 2>&1
      echo "$peer $part: exit $?" | tee -a "$out/runs.txt"
    done
    $PY benchmarks/peers_step.py --collect "$out" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
