#!/usr/bin/env bash
# GPU check in one go (about 5-8 minutes, stopped at 10): GPT-2 124M, B=16, T=1024, bf16, torch.compile per block.
# Runs the benchmark at TP=1, and with several GPUs also TP=2 and DP=2 (and TP=N when there are N > 2), then
# prints tokens/s and MFU per layout. With several GPUs it also runs TP=2 eager with gpt_tp's plan and with the
# overlapped MLP (--plan benchmarks.plans:overlap2, eager only), to see whether the overlap earns a place.
# Results: gpu_check_out/bench.{md,json,png} and gpu_check_out/overlap/bench.{md,json,png}.
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
NEAGER=0
if [ "$NGPU" -ge 2 ]; then NEAGER=2; fi  # TP=2 eager: gpt_tp's plan and overlap2
EAGER_RUN=60  # seconds for an eager run (no compilation)
PER_RUN=$(((LIMIT - NEAGER * EAGER_RUN) / NRUNS))
rc=0
timeout --signal=INT $((PER_RUN * NRUNS)) python -m benchmarks.bench --model "$MODEL" --layouts "$LAYOUTS" \
  --precision bf16-mixed --compile on --batch-size "$BATCH" --seq-len "$SEQ" --warmup 10 --steps 20 --timeout "$PER_RUN" \
  --out "$OUT" || rc=$?
[ -f "$OUT/bench.json" ] || { echo "gpu_check: no $OUT/bench.json (stopped after $((PER_RUN * NRUNS))s?)" >&2; exit 1; }
RESULTS="$OUT/bench.json"
if [ "$NEAGER" -gt 0 ]; then
  rm -f "$OUT/overlap/bench.json"
  timeout --signal=INT $((EAGER_RUN * NEAGER)) python -m benchmarks.bench --model "$MODEL" --layouts 1x2 \
    --plan gpt_tp.parallel:TP_PLAN,benchmarks.plans:overlap2 --precision bf16-mixed --compile off --batch-size "$BATCH" \
    --seq-len "$SEQ" --warmup 10 --steps 20 --timeout "$EAGER_RUN" --out "$OUT/overlap" || rc=$?
  if [ -f "$OUT/overlap/bench.json" ]; then RESULTS="$RESULTS $OUT/overlap/bench.json"; fi
fi
python - $RESULTS <<'PY'
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["runs"]:
        if "error" in r:
            print(f"{r['name']:<48} FAILED: {r['error']}")
        else:
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            print(f"{r['name']:<48} {r['tokens_per_s']:>12,.0f} tok/s   MFU {mfu:>6}   "
                  f"step {1e3 * r['step_time_s']['median']:.1f} ms   peak mem {max(r['peak_memory_bytes']) / 2**30:.1f} GiB")
PY
exit $rc
