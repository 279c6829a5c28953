#!/usr/bin/env bash
# The Qwen3-8B recipe through the user's own `fit` on one H200 (issues 25 and 26), in parts of one device call each:
#   bash benchmarks/recipe_h200.sh OUT_DIR saves   configs/qwen3-8b.yaml as shipped (FP8 drafter and target): 80
#                                                  steps with no save, a periodic save (every 100 steps) and the steps
#                                                  after it,
#                                                  SIGTERM at step 190 (the preemption save, signal to exit); then
#                                                  qwen3-8b-dflash2.yaml and qwen3-8b.yaml in bf16 (--model.fp8=none
#                                                  --target.fp8=false), no saves
#   bash benchmarks/recipe_h200.sh OUT_DIR gap     qwen3-8b.yaml as shipped with no save, PROFILE (6) steps profiled,
#                                                  then the benchmark's co-located pipeline at the same 3072/512 (the
#                                                  target compiled, in FP8 as shipped or PIPE_TARGETS=bf16; bf16 and
#                                                  FP8 tensorwise drafters)
#   bash benchmarks/recipe_h200.sh OUT_DIR preempt qwen3-8b.yaml as shipped, SIGTERM at step 25: signal to saved and
#                                                  to exit (FIT_BENCH_TEARDOWN_STACKS=2 prints where the exit waits)
#   bash benchmarks/recipe_h200.sh OUT_DIR target-fp8  qwen3-8b.yaml as shipped (the FP8 target beside the FP8
#                                                  drafter), no save; BASELINE=1 also with --target.fp8=false
#   bash benchmarks/recipe_h200.sh OUT_DIR quality the quality behind the settings (about 20 minutes): the tiny
#                                                  default trained on bf16 and on FP8 target features, served by the
#                                                  same target (seeds 0 1 2), beside the FP8 loss curves at the
#                                                  Qwen3-8B drafter shape (CURVE_ARMS, CURVE_STEPS long / 400 short)
# Writes OUT_DIR/<name>.json and one log per part. FIT_S caps each fit (300 s).
set -u -o pipefail
out=${1:?OUT_DIR}; part=${2:?saves|gap|preempt|target-fp8|quality}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-recipe}
fit() {  # name config [fit_bench args] [-- fit args]
  local name=$1 config=$2; shift 2
  timeout ${FIT_S:-300} python3 benchmarks/fit_bench.py --config configs/$config.yaml --out "$out/$name.json" --clean "$@" \
    >> "$out/$part.log" 2>&1 || echo "$name: exit $?" >> "$out/$part.log"
}
case $part in
  saves)
    fit fit-saves qwen3-8b --warmup 20 --steps 80 --after 100 --save-every 100 --sigterm-at 190
    fit fit-dflash2 qwen3-8b-dflash2 --warmup 20 --steps 80
    fit fit-bf16 qwen3-8b --warmup 20 --steps 80 -- --model.fp8=none --target.fp8=false ;;
  preempt)
    fit fit-preempt qwen3-8b --warmup 10 --steps 10 --after 20 --sigterm-at 25 ;;
  target-fp8)
    fit fit-target-fp8 qwen3-8b --warmup 20 --steps 80
    [ -n "${BASELINE:-}" ] && fit fit-target-bf16 qwen3-8b --warmup 20 --steps 80 -- --target.fp8=false ;;
  quality)
    python3 benchmarks/objective_ab.py --recipes target-bf16,target-fp8 --seeds 0,1,2 --device cuda --jobs 6 \
      --threads 2 --work /tmp/target-ab --out "$out/tiny-target-fp8-ab.json" > "$out/target-ab.log" 2>&1 &
    python3 benchmarks/fp8_curves.py --arms "${CURVE_ARMS:-bf16-mixed@${CURVE_STEPS:-1500},all:tensorwise@${CURVE_STEPS:-1500},bf16-mixed,all:rowwise_forward_only}" \
      --steps 400 --seeds 0,1,2 --parallel 4 --speed benchmarks/results/h200-2026-12-02-step-fp8-recipes.json \
      --work /tmp/fp8-curves --out "$out/fp8-curves.json" > "$out/curves.log" 2>&1
    wait ;;
  gap)
    fit fit-fp8 qwen3-8b --warmup 20 --steps 80 --profile ${PROFILE:-6}
    timeout ${BENCH_S:-280} python3 benchmarks/step_bench.py --skip step,eager,warm,curves,tiny_features,profile \
      --token-budget 3072 --anchors 512 --doc-tokens ${DOC_TOKENS:-300,3000} --target-compile \
      --pipeline-targets ${PIPE_TARGETS:-fp8} --pipeline-pairs all --pipeline-fp8 all:tensorwise --warmup 20 --pipeline-steps 80 \
      --out "$out/bench-pipelines.json" 2>&1 | grep --line-buffered -v Warning >> "$out/$part.log" ;;
esac
