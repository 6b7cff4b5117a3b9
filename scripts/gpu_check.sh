#!/usr/bin/env bash
# GPU check in one go (about 5-8 minutes, stopped at 10): GPT-2 124M, B=16, T=1024, bf16, torch.compile per block.
# Runs the benchmark at TP=1, and with several GPUs also TP=2 and DP=2 (and TP=N when there are N > 2), then
# prints tokens/s and MFU per layout. Results: gpu_check_out/bench.{md,json,png}.
#   bash scripts/gpu_check.sh                 # defaults
#   MODEL=gpt2-medium BATCH=8 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-gpt2}
BATCH=${BATCH:-16}
SEQ=${SEQ:-1024}
OUT=${OUT:-gpu_check_out}
LIMIT=${LIMIT:-570}  # seconds for the whole benchmark, under the 10-minute budget

NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 1 ]; then
  echo "gpu_check: torch sees no CUDA GPU (torch $(python -c 'import torch; print(torch.__version__)')); run it on a GPU machine" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
LAYOUTS="1x1"
if [ "$NGPU" -ge 2 ]; then LAYOUTS="$LAYOUTS,1x2,2x1"; fi
if [ "$NGPU" -ge 4 ]; then LAYOUTS="$LAYOUTS,1x4,2x2"; fi
echo "gpu_check: $NGPU GPU(s), layouts (DPxTP) $LAYOUTS, $MODEL B=$BATCH T=$SEQ bf16-mixed, compile on"

# 10 warm-up steps cover compilation; 20 timed steps; each run is stopped after its share of the time
NRUNS=$(echo "$LAYOUTS" | tr ',' '\n' | wc -l)
rc=0
timeout --signal=INT "$LIMIT" python -m gpt_tp.perf.bench --model "$MODEL" --layouts "$LAYOUTS" --precision bf16-mixed \
  --compile on --batch-size "$BATCH" --seq-len "$SEQ" --warmup 10 --steps 20 --timeout $((LIMIT / NRUNS)) --out "$OUT" || rc=$?
[ -f "$OUT/bench.json" ] || { echo "gpu_check: no $OUT/bench.json (stopped after ${LIMIT}s?)" >&2; exit 1; }
python - "$OUT/bench.json" <<'PY'
import json, sys
res = json.load(open(sys.argv[1]))
for r in res["runs"]:
    if "error" in r:
        print(f"{r['name']:<32} FAILED: {r['error']}")
    else:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"{r['name']:<32} {r['tokens_per_s']:>12,.0f} tok/s   MFU {mfu:>6}   "
              f"step {1e3 * r['step_time_s']['median']:.1f} ms   peak mem {max(r['peak_memory_bytes']) / 2**30:.1f} GiB")
PY
exit $rc
