#!/usr/bin/env bash
# Precision and FP8 on one H200 (issues 14 and 17), in parts that fit one device call each:
#   bash benchmarks/precision_h200.sh OUT_DIR speed     drafter step bf16-true / bf16-mixed / FP8, co-located
#                                                       pipelines (8192/512 and the recipe's 3072/512), projection
#   bash benchmarks/precision_h200.sh OUT_DIR pipelines the co-located pipelines only: bf16 target + bf16 drafter and
#                                                       FP8 target + FP8 drafter (PIPE_FP8, all:tensorwise), both shapes;
#                                                       TARGET_COMPILE=1: the target's layers compiled
#   bash benchmarks/precision_h200.sh OUT_DIR quality   loss curves bf16 vs FP8 on the same batches (CURVES=1; with
#                                                       CURVE_SKIP= also the tiny target's FP8 features), and the tiny
#                                                       default trained on the GPU per precision and seed (RUNS or
#                                                       SEEDS x ARMS): val loss, served tau
# Needs torchao (pip install 'torchao>=0.17'). Writes OUT_DIR/{speed,quality}.json, tiny.json and logs
# (and $OUT/bench.json, the partial results, where OUT is set). STAGE_TIMEOUT=S stops a part after S seconds
# and reports the stack it was in.
set -u -o pipefail
out=${1:?OUT_DIR}; part=${2:?speed|pipelines|quality}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-precision}
bench="python3 benchmarks/step_bench.py --warmup ${WARMUP:-12} --steps ${STEPS:-30} --pipeline-steps ${PIPE_STEPS:-40} --stage-timeout ${STAGE_TIMEOUT:-0}"
if [ "$part" = speed ]; then  # everything timed, one run (about 10 minutes)
  $bench --modes "${MODES-default}" --precisions ${PRECISIONS:-bf16-true,bf16-mixed} --fp8 ${FP8:-head:rowwise,all:rowwise,all:tensorwise} \
    --skip eager,warm,curves,tiny_features --out "$out/speed.json" 2>&1 | grep --line-buffered -v Warning > "$out/speed.log"
  exit
fi
if [ "$part" = pipelines ]; then  # the co-located pipelines alone, bf16 and FP8 in one run (about 5 minutes)
  $bench --skip step,eager,warm,curves,tiny_features --pipeline-fp8 ${PIPE_FP8:-all:tensorwise} ${TARGET_COMPILE:+--target-compile} \
    --out "$out/pipelines.json" 2>&1 | grep --line-buffered -v Warning > "$out/pipelines.log"
  exit
fi
repo=$PWD
tiny() {  # arm seed precision [extra CLI args]: fit the tiny default in its own folder, then evaluate it
  local arm=$1 seed=$2 precision=$3; shift 3
  local dir=/tmp/tiny-$arm-$seed
  rm -rf "$dir"; mkdir -p "$dir"; ln -s "$repo/dflash_lightning" "$repo/configs" "$dir/"
  (cd "$dir" && OMP_NUM_THREADS=2 timeout ${FIT_S:-600} python3 -m dflash_lightning fit --config configs/tiny.yaml --seed_everything=$seed \
      --trainer.accelerator=gpu --trainer.precision=$precision "$@" &&
   OMP_NUM_THREADS=2 timeout ${EVAL_S:-600} python3 -m dflash_lightning evaluate --drafter runs/tiny/checkpoints/last.ckpt \
      --prompts dflash_lightning/assets/tiny/data/prompts.jsonl --device cuda --dtype float32 --out runs/tiny/eval
  ) > "$out/tiny-$arm-$seed.log" 2>&1 || echo "tiny $arm $seed failed"
}
[ -n "${CURVES:-}" ] && $bench --skip step,pipeline,eager,warm,${CURVE_SKIP:-tiny_features} --curve-steps ${CURVE_STEPS:-200} \
  --curves ${CURVE_MODES:-bf16-true,bf16-mixed,head:rowwise,all:tensorwise} --curve-seeds ${CURVE_SEEDS:-0} --out "$out/quality.json" 2>&1 \
  | grep --line-buffered -v Warning > "$out/quality.log" &
runs=${RUNS:-$(for s in ${SEEDS:-0 1}; do for a in ${ARMS:-true mixed fp8head fp8all}; do echo "$a:$s"; done; done)}
for run in $runs; do  # arm:seed pairs (RUNS="true:0 mixed:2"), or every arm of every seed
  arm=${run%%:*} seed=${run##*:}
  case $arm in
    true) tiny true $seed bf16-true & ;;
    mixed) tiny mixed $seed bf16-mixed & ;;
    fp8head) tiny fp8head $seed bf16-mixed --model.fp8=head & ;;
    fp8all) tiny fp8all $seed bf16-mixed --model.fp8=all & ;;
  esac
done
[ -n "${SEPARATE:-}" ] && tiny fp8target-separate 0 bf16-mixed --model.fp8=head --target.fp8=true \
  --target.dtype=bfloat16 --target.placement=separate '--target.target_devices=[cuda:0]' --trainer.max_steps=40 &
wait
tar czf "$out/tiny-logs.tgz" -C "$out" $(cd "$out" && ls tiny-*.log) && rm -f "$out"/tiny-*.log
names="$(for run in $runs; do echo "${run%%:*}-${run##*:}"; done) ${SEPARATE:+fp8target-separate-0}"
python3 - "$out" $names <<'PY'
import csv, json, sys
from pathlib import Path
rows = {}
for name in sys.argv[2:]:  # this call's runs only: a warm machine keeps earlier calls' folders
    folder = f"/tmp/tiny-{name}"
    row = {}
    for metrics in Path(folder).glob("runs/tiny/dflash/version_*/metrics.csv"):
        for r in csv.DictReader(metrics.open()):
            for key in ("val/loss", "val/tau", "val/tau_served", "train/loss"):
                if r.get(key):
                    row[key] = float(r[key])  # the last logged value
    report = Path(folder, "runs/tiny/eval/report.json")
    if report.exists():
        rep = json.loads(report.read_text())
        row["eval"] = {k: v for k, v in rep.items() if not isinstance(v, (list, dict)) or k == "summary"}
    rows[name] = row
Path(sys.argv[1], "tiny.json").write_text(json.dumps(rows, indent=2) + "\n")
print(json.dumps(rows, indent=1))
PY
