#!/usr/bin/env bash
# Draft-OPD on SmolLM2-135M-Instruct, one GPU (docs/opd.md, "On SmolLM2"): per seed a DFlash drafter trained by
# configs/smollm2-135m-gpu.yaml for STEPS1 steps on the target's own answers, then four arms of STEPS2 more steps from
# it (configs/stages/smollm2-135m-opd-gpu.yaml): supervision continued (sft), the stage with exact replay (opd),
# without replay (opd-approx), and the stage tuned on the tiny default (opd-tuned: lambda_rej 0.25, the supervised
# loss beside it); then every drafter served on held-out prompts at T 0 and 1. After smollm2_scale_gpu.sh's
# `stage 0..2` calls (the target's wheel), in the call of stage 2:
#   bash benchmarks/opd_smollm2_gpu.sh OUT               detached: target, answers, bases, arms, eval (progress.log)
#   WAIT=540 bash benchmarks/smollm2_scale_gpu.sh OUT wait        until "all: done", then OUT/scale.tgz
# DEVICE=cpu with the scale script's smoke settings (TARGET, PROMPTS, LIMIT, EXTRA) runs every part on the CPU.
set -u -o pipefail
out=${1:?OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
scale=$repo/benchmarks/smollm2_scale_gpu.sh
KEEP=${KEEP:-/root/keep}; WORK=${WORK:-$KEEP/scale}
TARGET=${TARGET:-$HOME/.cache/dflash_lightning/smollm2-135m-instruct}
SEEDS=${SEEDS:-0 1}; STEPS1=${STEPS1:-1000}; STEPS2=${STEPS2:-250}
export KEEP WORK TARGET
declare -A ARMS=(
  [sft]="model.stage=sft"
  [opd]="model.stage=opd"
  [opd-approx]="model.stage=opd,model.opd.replay=false"
  [opd-tuned]="model.stage=opd,model.opd.lambda_rej=0.25,model.opd.sft_weight=1.0"
)
bases= arms=
for s in $SEEDS; do
  bases+="base-s$s:model.drafter.variant=dflash,seed_everything=$s,trainer.max_steps=$STEPS1"
  bases+=",trainer.val_check_interval=$((STEPS1 / 2)),spec_eval.every_n_steps=$((STEPS1 / 2)) "
  ckpt=$WORK/base-s$s/runs/smollm2-135m-gpu/checkpoints/last.ckpt
  for arm in sft opd opd-approx opd-tuned; do
    arms+="$arm-s$s:${ARMS[$arm]},model.init_from=$ckpt,seed_everything=$s,trainer.max_steps=$STEPS2"
    arms+=",trainer.val_check_interval=$STEPS2,spec_eval.every_n_steps=$STEPS2 "
  done
done
mkdir -p "$WORK"
echo "$(date +%T) opd: bases [$bases] arms [$arms]" >> "$WORK/progress.log"
# one chain, detached (the scale script's `all` does the same): a failed part stops it, a failed fit does not
setsid nohup bash -c "
  step() { echo \"\$(date +%T) \$*\" >> '$WORK/progress.log'; }
  [ -f '$TARGET/config.json' ] || bash '$scale' '$out' target || { step 'all: target failed'; exit 1; }
  # the target's features on the GPU's backends against each document's own forward (a leak shows here)
  python3 '$repo/benchmarks/train_serve_parity.py' features --device '${DEVICE:-cuda}' --target '$TARGET' \
    --out '$WORK/parity-features.json' > '$WORK/parity-features.log' 2>&1; step \"parity features: exit \$?\"
  bash '$scale' '$out' answers || { step 'all: answers failed'; exit 1; }
  RUNS='$bases' bash '$scale' '$out' fit
  # seed 0's base validated under the GPU's paths (beside the arms): the training estimate must not depend on them
  (cd '$WORK/base-s${SEEDS%% *}' && python3 '$repo/benchmarks/train_serve_parity.py' validate \
    --config configs/smollm2-135m-gpu.yaml --ckpt runs/smollm2-135m-gpu/checkpoints/last.ckpt \
    --settings gpu-fp32-eager,gpu-bf16-compiled,gpu-bf16-compiled-sdpa --set=--model.drafter.variant=dflash \
    --set=--trainer.logger=false --set=--target.path='$TARGET' \
    --out '$WORK/parity-validate.json' > '$WORK/parity-validate.log' 2>&1; step \"parity validate: exit \$?\") &
  RUNS='$arms' CONFIG=configs/stages/smollm2-135m-opd-gpu.yaml bash '$scale' '$out' fit
  wait
  RUNS='$bases$arms' SETS=heldout SPEED=0 bash '$scale' '$out' eval
  step 'all: done'" > "$WORK/all.log" 2>&1 < /dev/null &
echo "$(date +%T) opd: started" | tee -a "$WORK/progress.log"
