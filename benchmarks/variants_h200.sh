#!/usr/bin/env bash
# LiLiCorr and DSpark against DFlash2 and DFlash on one H200 (issues 36, 37), in parts that fit one device call each:
#   bash benchmarks/variants_h200.sh OUT_DIR step   the drafter step at the Qwen3-8B shape (8192/512, compiled), one
#                                                   variant after another in one call: bf16-mixed, then the configs'
#                                                   FP8 (all:tensorwise), decay slot weights for all (dspark refuses
#                                                   D-PACE); VARIANTS="dflash dflash2 lilicorr-conv dspark"
#   bash benchmarks/variants_h200.sh OUT_DIR ab     the tiny default A/B: DFlash2, LiLiCorr, LiLiCorr+conv, DSpark at
#                                                   block 16 and DFlash2, LiLiCorr+conv, DSpark at block 7, seeds 0 1 2,
#                                                   served tau at temperature 0, 0.6, 1 (fit and evaluate on the GPU);
#                                                   BACKGROUND=1 starts it detached (collect with `ab-wait`)
#   bash benchmarks/variants_h200.sh OUT_DIR fit    the user's `fit --config configs/qwen3-8b-{lilicorr,dspark}.yaml`
#                                                   at the recipe's shape, a random whole (36-layer) Qwen3-8B target
set -u -o pipefail
out=${1:?OUT_DIR}; part=${2:?step|ab|ab-wait|fit}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-variants}
AB_RECIPES=${AB_RECIPES:-dflash2-dpace-ce,lilicorr-dpace-ce,lilicorr-conv-dpace-ce,dspark,dflash2-b7,lilicorr-conv-b7,dspark-b7}
AB_WORK=${AB_WORK:-/tmp/variants-ab}
case $part in
  step)
    for v in ${VARIANTS:-dflash dflash2 lilicorr-conv dspark}; do
      timeout ${STEP_TIMEOUT:-300} python3 benchmarks/step_bench.py --variant $v --modes "" --precisions bf16-mixed \
        --fp8 "${FP8-all:tensorwise}" --loss-weights decay --skip eager,warm,curves,tiny_features,pipeline,profile \
        --warmup ${WARMUP:-12} --steps ${STEPS:-30} --out "$out/step-$v.json" 2>&1 |
        grep --line-buffered -v Warning > "$out/step-$v.log"
      echo "step $v: exit ${PIPESTATUS[0]}" >> "$out/step-$v.log"
    done ;;
  ab)
    cmd=(python3 benchmarks/objective_ab.py --recipes "$AB_RECIPES" --seeds ${SEEDS:-0,1,2} --temperatures 0,0.6,1
         --device cuda --jobs ${JOBS:-11} --threads 1 --work "$AB_WORK" --out "$AB_WORK/tiny-variants-ab.json")
    if [ "${BACKGROUND:-0}" = 1 ]; then
      mkdir -p "$AB_WORK"; setsid nohup "${cmd[@]}" > "$AB_WORK/ab.log" 2>&1 < /dev/null &
    else
      "${cmd[@]}" > "$out/ab.log" 2>&1; cp "$AB_WORK/tiny-variants-ab.json" "$out/"
    fi ;;
  ab-wait)  # wait (up to WAIT seconds) for a background A/B, then bring back its results and log
    end=$((SECONDS + ${WAIT:-540}))
    while [ ! -f "$AB_WORK/tiny-variants-ab.json" ] && [ $SECONDS -lt $end ]; do sleep 10; done
    cp "$AB_WORK/ab.log" "$out/" 2>/dev/null; cp "$AB_WORK/tiny-variants-ab.json" "$out/" 2>/dev/null
    ls "$AB_WORK" > "$out/ab-runs.txt" ;;
  fit)
    for c in ${CONFIGS:-qwen3-8b-lilicorr qwen3-8b-dspark}; do
      timeout ${FIT_TIMEOUT:-420} python3 benchmarks/fit_bench.py --config configs/$c.yaml --target-layers 36 \
        --warmup ${WARMUP:-20} --steps ${STEPS:-40} --clean --out "$out/fit-$c.json" ${FIT_ARGS:+-- $FIT_ARGS} \
        > "$out/fit-$c.log" 2>&1
      echo "fit $c: exit $?" >> "$out/fit-$c.log"
    done ;;
esac
