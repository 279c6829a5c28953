#!/usr/bin/env bash
# One H200: the training objectives' cost at the Qwen3-8B recipe shape (ce, kl, dpace; bf16 compute over fp32
# masters, as the GPU configs), then configs/qwen3-8b-long.yaml's shape (32K rows, 2048 anchors, four W=2048
# sliding layers, co-located target). Usage: bash benchmarks/objectives_long_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: objectives_long_h200.sh OUT_DIR}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-objectives} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step="--modes= --precisions bf16-mixed --fp8= --warmup 12 --steps 30"
skip="eager,warm,curves,tiny_features,profile,pipeline"
bench() { name=$1; shift; mkdir -p "$out/$name"; OUT="$out/$name" python3 benchmarks/step_bench.py "$@" --out "$out/$name.json"; }
bench ce $step --skip $skip --objective ce --loss-weights decay
bench kl $step --skip $skip --objective kl --loss-weights decay
bench long --loss-weights decay --modes= --precisions bf16-mixed --fp8= --warmup 8 --steps 20 --pipeline-steps 20 --token-budget 32768 \
    --anchors 2048 --sliding-layers 4 --sliding-window 2048 --doc-tokens 4096,32768 --recipe-shape 32768,2048 \
    --skip eager,warm,curves,tiny_features,profile,fp8_target
bench dpace $step --skip $skip --loss-weights dpace
