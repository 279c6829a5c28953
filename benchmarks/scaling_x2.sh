#!/usr/bin/env bash
# The 2-GPU layouts of the online pipeline, one after another, on a random Qwen3-8B-shaped target.
#   bash benchmarks/scaling_x2.sh OUT_DIR [layouts...]   (layouts: base ddp separate sharded fsdp; default all)
# Appends one JSON line per layout to OUT_DIR/scaling.jsonl; each layout's log goes to OUT_DIR/<layout>.log.
set -u
out=${1:?OUT_DIR}; shift
layouts=${*:-base ddp separate sharded fsdp}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-scaling}
target=${TARGET:-/tmp/qwen3-8b-random}
bench="python3 benchmarks/scaling_bench.py --target $target --out $out/scaling.jsonl"
[ -f "$target/config.json" ] || python3 benchmarks/scaling_bench.py --make-target "$target" || exit 1
base() { grep -s '"devices": 1, "gpus": 1' "$out/scaling.jsonl" | tail -1 | python3 -c \
  "import json,sys; t=sys.stdin.read(); print('--baseline', json.loads(t)['context_tokens_per_s']) if t else None"; }
for layout in $layouts; do
  case $layout in
    base) args="--devices 1 --steps 100" ;;
    ddp) args="--devices 2 --strategy ddp --steps 200 $(base)" ;;
    separate) args="--devices 1 --trainer-gpus 1 --placement separate --target-devices cuda:0 --steps 200 $(base)" ;;
    sharded) args="--devices 2 --strategy ddp --placement sharded --steps 100 $(base)" ;;
    fsdp) args="--devices 2 --strategy fsdp --steps ${FSDP_STEPS:-100} $(base)" ;;
    *) echo "unknown layout $layout"; exit 2 ;;
  esac
  echo "== $layout: $args ($SECONDS s)"
  $bench $args > "$out/$layout.log" 2>&1 || { echo "$layout failed:"; grep -v Warning "$out/$layout.log" | tail -15; }
done
cat "$out/scaling.jsonl"
