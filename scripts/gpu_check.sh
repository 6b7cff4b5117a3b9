#!/usr/bin/env bash
# The first check on a GPU machine (docs/scale.md, "First GPU run"): what a user runs first, then the benchmark.
#   bash scripts/setup.sh && bash scripts/gpu_check.sh     # 1 or 2 GPUs (TP=2 with 2 or more, else TP=1)
#   NGPU=2 bash scripts/gpu_check.sh --dry-run              # any machine: the stages, their limits, the sum, the table
# Stages, in this order, each under its own limit (seconds), which add up to at most LIMIT (9 minutes) below:
#   gpu-tests  pytest -m gpu tests/test_gpu.py
#   fit        cli.py fit --config configs/tp2.yaml on data/sample, B=8 x T=1024 a step (8192 tokens), 20 steps planned,
#              stopped after step 10 as a preemption would, saved at 10; HellaSwag (the fixture) at step 10
#   resume     the same with --ckpt_path last: steps 11-20, saved at 20
#   validate   cli.py validate from the last checkpoint (val loss, HellaSwag on the fixture), eager
#   bench      python -m benchmarks.bench: GPT-2 124M, DP=1 x TP=1, B=16, T=1024, bf16-mixed, compiled
# OUT (default gpu_check_out) is emptied first; each stage writes OUT/<stage>.json as soon as it ends, so a check
# stopped part-way keeps what it measured. It ends with one table (OUT/summary.md; compile s = the first step's time
# less the median step's) and exits 1 if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python  # what scripts/setup.sh makes
OUT=${OUT:-gpu_check_out}
LIMIT=540   # the whole check, seconds
SETUP=15    # counting the GPUs, nvidia-smi, writing the configs and results
KILL=5      # a stage past its limit gets SIGINT, then SIGKILL this much later
STAGES="gpu-tests fit resume validate bench"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
[ -x "$PY" ] || { echo "error: gpu_check: no $PY: run bash scripts/setup.sh first" >&2; exit 2; }
if [ "$DRY" = 1 ]; then NGPU=${NGPU:-1}; else NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())"); fi
if [ "$NGPU" -lt 1 ]; then
  echo "error: gpu_check: torch sees no CUDA GPU; run it on a GPU machine (or --dry-run to see the stages)" >&2
  exit 2
fi
TP=$((NGPU >= 2 ? 2 : 1))
declare -A LIMITS=([gpu-tests]=$((TP == 2 ? 120 : 80)) [fit]=120 [resume]=80 [validate]=45 [bench]=80)
TOTAL=$SETUP
SUM="setup $SETUP"
for s in $STAGES; do TOTAL=$((TOTAL + LIMITS[$s] + KILL)); SUM="$SUM + $s ${LIMITS[$s]}+$KILL"; done
echo "gpu_check: $NGPU GPU(s), TP=$TP; limits: $SUM = $TOTAL s of $LIMIT"
if [ "$TOTAL" -gt "$LIMIT" ]; then echo "error: gpu_check: the limits add up to $TOTAL s, over $LIMIT" >&2; exit 2; fi

if [ -e "$OUT" ] && [ ! -e "$OUT/.gpu_check" ]; then
  echo "error: gpu_check: $OUT exists and is not a gpu_check folder; set OUT to another folder" >&2
  exit 2
fi
rm -rf "$OUT" && mkdir -p "$OUT" && touch "$OUT/.gpu_check"  # no result of an earlier check is reported
[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
B=8; T=1024
# the fit's callbacks and logger, per stage (a list given again replaces the whole list)
stage_config() {  # stage_config NAME [STEP]: OUT/NAME.yaml (with STEP: the fit stops after it, as a preemption would)
  local stop=""
  [ -n "${2:-}" ] && stop="  - {class_path: tests.workers.stop_at.StopAt, init_args: {step: $2}}"$'\n'
  cat > "$OUT/$1.yaml" <<EOF
trainer:
  devices: $TP
  max_steps: 20
  accumulate_grad_batches: 1
  val_check_interval: 10
  log_every_n_steps: 1
  logger:
  - class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {save_dir: $OUT/logs, name: $1, version: 0}
  callbacks:
  - class_path: gpt_tp.checkpoint.AtomicModelCheckpoint
    init_args: {dirpath: $OUT/ckpt, filename: "step{step:07d}", auto_insert_metric_name: false,
                every_n_train_steps: 10, save_top_k: 2, monitor: step, mode: max, save_last: link}
  - class_path: gpt_tp.eval.hellaswag.HellaSwagCallback
    init_args: {path: tests/fixtures/hellaswag_small.jsonl, every_n_steps: 10}
${stop}model:
  warmup_steps: 5
  total_batch_size: $((B * T))
data:
  data_dir: data/sample
  batch_size: $B
  seq_len: $T
  val_batches: 2
EOF
  echo "$OUT/$1.yaml"
}
FIT=(cli.py fit --config configs/tp2.yaml --trainer.strategy.init_args.tensor_parallel_size "$TP")

FAILED=0
stage() {  # stage NAME COMMAND...: run under its limit, output in OUT/NAME.log, then OUT/NAME.json at once
  local name=$1 rc=0 t0=$SECONDS
  shift
  echo "gpu_check: $name (limit ${LIMITS[$name]} s): $*"
  if [ "$DRY" = 1 ]; then
    [ "${FAIL_STAGE:-}" = "$name" ] && rc=1
  else
    timeout --signal=INT --kill-after=$KILL "${LIMITS[$name]}" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  fi
  [ "$rc" = 0 ] || FAILED=1
  "$PY" - "$OUT" "$name" "$rc" $((SECONDS - t0)) $((B * T)) "$DRY" <<'PY'
import csv, json, os, statistics, sys
out, name, rc, seconds, tokens, dry = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
r = {"stage": name, "ok": rc == 0, "rc": rc, "seconds": seconds, "tok_s": None, "mfu": None, "peak_gib": None,
     "compile_s": None, "note": "dry run" if dry else "timed out" if rc in (124, 137) else ""}
def num(row, key):
    v = row.get(key)
    return float(v) if v not in (None, "", "nan") else None
csv_path = os.path.join(out, "logs", name, "version_0", "metrics.csv")
rows = list(csv.DictReader(open(csv_path))) if os.path.exists(csv_path) else []
steps = [row for row in rows if num(row, "train/tokens_per_sec")]
if steps:  # fit, resume: the first step holds compilation; the others are the steady state
    tok = [num(row, "train/tokens_per_sec") for row in steps]
    steady = tok[1:] or tok
    r["tok_s"] = statistics.median(steady)
    mfu = [m for m in (num(row, "train/mfu") for row in steps[1:]) if m is not None]
    r["mfu"] = statistics.median(mfu) if mfu else None
    peaks = [p for p in (num(row, "train/peak_memory_gib") for row in steps) if p is not None]
    r["peak_gib"] = max(peaks) if peaks else None
    r["compile_s"] = tokens / tok[0] - tokens / r["tok_s"]
    r["note"] = f"{len(steps)} steps logged {r['note']}".strip()
for key in ("val/loss", "hellaswag/acc_norm"):  # fit, resume, validate
    vals = [num(row, key) for row in rows if num(row, key) is not None]
    if vals:
        r["note"] = f"{r['note']} {key} {vals[-1]:.4f}".strip()
bench = os.path.join(out, "bench", "bench.json")
if name == "bench" and os.path.exists(bench):
    for run in json.load(open(bench))["runs"][:1]:
        if "error" in run:
            r["ok"], r["note"] = False, str(run["error"])[:120]
            continue
        r["tok_s"], r["mfu"] = run["tokens_per_s"], run["mfu"]
        r["peak_gib"] = max(run["peak_memory_bytes"]) / 2**30
        step = run["step_time_s"]["median"]
        r["compile_s"] = run["first_step_s"] - step if run.get("first_step_s") is not None else None
        r["note"] = f"step {1e3 * step:.1f} ms"
elif name == "bench" and rc == 0 and not dry:
    r["ok"], r["note"] = False, "no bench.json"
if name == "gpu-tests" and os.path.exists(log := os.path.join(out, name + ".log")):
    lines = [l for l in open(log).read().splitlines() if " passed" in l or " failed" in l or " skipped" in l]
    r["note"] = (lines[-1].strip("= ") if lines else r["note"])[:80]
with open(os.path.join(out, name + ".json.tmp"), "w") as f:
    json.dump(r, f)
os.replace(os.path.join(out, name + ".json.tmp"), os.path.join(out, name + ".json"))
sys.exit(0 if r["ok"] else 1)
PY
  [ $? = 0 ] || FAILED=1
}

stage gpu-tests "$PY" -m pytest -q -m gpu tests/test_gpu.py
stage fit "$PY" "${FIT[@]}" --config "$(stage_config fit 10)"
stage resume "$PY" "${FIT[@]}" --config "$(stage_config resume)" --ckpt_path last
stage validate "$PY" cli.py validate --config configs/tp2.yaml --config "$(stage_config validate)" \
  --trainer.strategy.init_args.tensor_parallel_size "$TP" --model.compile false --ckpt_path "$OUT/ckpt/last.ckpt"
stage bench "$PY" -m benchmarks.bench --model gpt2 --layouts 1x1 --precision bf16-mixed --compile on --batch-size 16 \
  --seq-len 1024 --warmup 5 --steps 10 --timeout $((LIMITS[bench] - 10)) --out "$OUT/bench"

"$PY" - "$OUT" $STAGES <<'PY' | tee "$OUT/summary.md"
import json, os, sys
out, stages = sys.argv[1], sys.argv[2:]
fmt = lambda v, f: "n/a" if v is None else f.format(v)
print("| stage | result | s | tok/s | MFU | peak mem GiB | compile s | note |")
print("|---|---|---:|---:|---:|---:|---:|---|")
for name in stages:
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        print(f"| {name} | not run | | | | | | |")
        continue
    r = json.load(open(path))
    print(f"| {name} | {'pass' if r['ok'] else 'FAIL (' + str(r['rc']) + ')'} | {r['seconds']} | "
          f"{fmt(r['tok_s'], '{:,.0f}')} | {fmt(r['mfu'], '{:.1%}')} | {fmt(r['peak_gib'], '{:.2f}')} | "
          f"{fmt(r['compile_s'], '{:.1f}')} | {r['note']} |")
PY
[ "$FAILED" = 0 ] || echo "gpu_check: a stage failed; its output is in $OUT/<stage>.log" >&2
exit $FAILED
