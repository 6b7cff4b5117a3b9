#!/usr/bin/env bash
# GPU check in one go (about 5-8 minutes, stopped at 10): GPT-2 124M, B=16, T=1024, bf16, torch.compile per block.
# Runs the benchmark at TP=1, and with several GPUs also TP=2 and DP=2 (and TP=N when there are N > 2), then
# prints tokens/s and MFU per layout. With several GPUs it also runs TP=2 eager with gpt_tp's plan and with the
# overlapped MLP (--plan benchmarks.plans:overlap2, eager only), to see whether the overlap earns a place.
# Then Muon (model.optimizer=Muon, compiled) at TP=1, and TP=2 with several GPUs: tok/s, MFU and the share of the
# step Newton-Schulz takes; a Muon run that fails or reports no share fails the check (exit 1).
# Results: gpu_check_out/bench.{md,json,png}, gpu_check_out/overlap/... and gpu_check_out/muon/....
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
MUON_LAYOUTS="1x1"
if [ "$NGPU" -ge 2 ]; then MUON_LAYOUTS="1x1,1x2"; fi
NMUON=$(echo "$MUON_LAYOUTS" | tr ',' '\n' | wc -l)
MUON_RUN=75  # seconds for a compiled Muon run
PER_RUN=$(((LIMIT - NEAGER * EAGER_RUN - NMUON * MUON_RUN) / NRUNS))
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
rm -f "$OUT/muon/bench.json"
timeout --signal=INT $((MUON_RUN * NMUON)) python -m benchmarks.bench --model "$MODEL" --layouts "$MUON_LAYOUTS" \
  --optimizer muon --precision bf16-mixed --compile on --batch-size "$BATCH" --seq-len "$SEQ" --warmup 10 --steps 20 \
  --timeout "$MUON_RUN" --out "$OUT/muon" || rc=$?
if [ -f "$OUT/muon/bench.json" ]; then RESULTS="$RESULTS $OUT/muon/bench.json"; else
  echo "gpu_check: Muon FAILED: no $OUT/muon/bench.json (stopped after $((MUON_RUN * NMUON))s?)" >&2; rc=1; fi
python - $RESULTS <<'PY' || rc=1
import json, sys
failed = False
for path in sys.argv[1:]:
    for r in json.load(open(path))["runs"]:
        if "error" in r or (r.get("optimizer") == "muon" and r.get("newton_schulz_share") is None):
            print(f"{r['name']:<48} FAILED: {r.get('error', 'no Newton-Schulz time recorded')}")
            failed = failed or r.get("optimizer") == "muon"
        else:
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            ns = r.get("newton_schulz_share")
            ns = "" if ns is None else f"   Newton-Schulz {100 * ns:.1f}% of the step"
            mem = max(r["peak_memory_bytes"]) / 2**30
            print(f"{r['name']:<48} {r['tokens_per_s']:>12,.0f} tok/s   MFU {mfu:>6}   step "
                  f"{1e3 * r['step_time_s']['median']:.1f} ms   peak mem {mem:.1f} GiB{ns}")
sys.exit(1 if failed else 0)
PY
exit $rc
