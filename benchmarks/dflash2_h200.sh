#!/usr/bin/env bash
# DFlash2 on one H200 (issue 24), in parts that fit one device call each:
#   bash benchmarks/dflash2_h200.sh OUT_DIR ab     the tiny default, DFlash vs DFlash2 (D-PACE, CE), seeds 0 1 2,
#                                                  served tau at temperature 0, 0.6, 1 (fit and evaluate on the GPU)
#   bash benchmarks/dflash2_h200.sh OUT_DIR step   the drafter step at the Qwen3-8B shape (8192/512, bf16-mixed,
#                                                  compiled), DFlash then DFlash2, same target and batches;
#                                                  FP8=all:tensorwise adds that FP8 step to each
#   bash benchmarks/dflash2_h200.sh OUT_DIR fit    the user's `fit --config configs/qwen3-8b{-dflash2,}.yaml` at the
#                                                  recipe's 3072/512 with a random Qwen3-8B-shaped target;
#                                                  PROFILE=N profiles N steps after the timed window;
#                                                  FIT_ARGS="--model.fp8=none --target.fp8=false" passes fit
#                                                  arguments (bf16 here: the configs run drafter and target in FP8)
#   bash benchmarks/dflash2_h200.sh OUT_DIR fsdp   the tiny default (DFlash2) under FSDP on one GPU: 20 steps, the
#                                                  same command again to 30 (a resume), then evaluate and export
set -u -o pipefail
out=${1:?OUT_DIR}; part=${2:?ab|step|fit|fsdp}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-dflash2}
case $part in
  ab)
    python3 benchmarks/objective_ab.py --recipes dpace-ce,dflash2-dpace-ce --seeds ${SEEDS:-0,1,2} \
      --temperatures 0,0.6,1 --device cuda --jobs ${JOBS:-6} --threads 2 --work ${WORK:-/tmp/dflash2-ab} \
      --out "$out/tiny-dflash2-ab.json" > "$out/ab.log" 2>&1 ;;
  step)
    for v in dflash dflash2; do
      python3 benchmarks/step_bench.py --variant $v --modes "" --precisions bf16-mixed --fp8 "${FP8:-}" \
        --skip eager,warm,curves,tiny_features,pipeline,profile --warmup ${WARMUP:-12} --steps ${STEPS:-30} \
        --out "$out/step-$v.json" 2>&1 | grep --line-buffered -v Warning > "$out/step-$v.log"
    done ;;
  fit)
    for c in ${CONFIGS:-qwen3-8b-dflash2 qwen3-8b}; do
      python3 benchmarks/fit_bench.py --config configs/$c.yaml --profile ${PROFILE:-0} --out "$out/fit-$c.json" \
        ${FIT_ARGS:+-- $FIT_ARGS} > "$out/fit-$c.log" 2>&1
    done ;;
  fsdp)
    dir=/tmp/tiny-fsdp; rm -rf $dir; mkdir -p $dir; ln -s "$PWD/dflash_lightning" "$PWD/configs" $dir/
    args="--config configs/tiny.yaml --trainer.accelerator=gpu --trainer.devices=1 --trainer.strategy=fsdp"
    (cd $dir && set -e && python3 -m dflash_lightning fit $args --trainer.max_steps=20 &&
     python3 -m dflash_lightning fit $args --trainer.max_steps=30 &&
     python3 -m dflash_lightning evaluate --drafter runs/tiny/checkpoints/last.ckpt --num_prompts 16 \
       --prompts dflash_lightning/assets/tiny/data/prompts.jsonl --device cuda --dtype float32 --out runs/tiny/eval &&
     python3 -m dflash_lightning export --checkpoint runs/tiny/checkpoints/last.ckpt --out runs/tiny/exported &&
     cp runs/tiny/eval/report.json "$out/fsdp-eval.json") > "$out/fsdp.log" 2>&1
    echo "fsdp: exit $?" >> "$out/fsdp.log" ;;
esac
