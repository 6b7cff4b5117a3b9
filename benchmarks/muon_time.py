"""Muon's step time over AdamW's through the real training command on CPU, pair by pair, at TP=2 and DP=2 x TP=1.

    python -m benchmarks.muon_time --pairs 4 --steps 12 --out muon_time

`python cli.py fit` on 2 processes (one thread each, fp32) as benchmarks.muon_sweep runs it (4 layers, n_embd 256,
T 256, micro-batch 4, Muon at lr 0.02 with its AdamW part at 3e-3, AdamW at 3e-3), validation only after the last
step. For each layout, --pairs pairs of runs, each pair AdamW then Muon or Muon then AdamW in turn, the layouts
interleaved, so each pair's two runs see about the same machine load. A run's step time: the median over its steps
after the first --skip (B x T x DP / the logged train/tokens_per_sec). Reported per layout: the Muon / AdamW ratio
of each pair, and their min / median / max.
"""

import json
import statistics
import sys
from pathlib import Path

from benchmarks.muon_sweep import fit_once
from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError

LAYOUTS = {"TP=2": 1, "DP=2 x TP=1": 2}  # name -> data-parallel size on 2 processes


def measure(args) -> dict:
    ratios: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    runs = []
    for i in range(args.pairs):
        for name, dp in LAYOUTS.items():
            pair = {}
            for opt in ("adamw", "muon") if i % 2 == 0 else ("muon", "adamw"):
                lr = 0.02 if opt == "muon" else args.muon_adamw_lr
                r = fit_once(args, opt, lr, Path(args.out) / f"{i}_{dp}_{opt}", dp)
                pair[opt] = statistics.median(t for s, t in r["step_s"].items() if s >= args.skip)
                runs.append({"pair": i, "layout": name, "optimizer": opt, "step_s": r["step_s"]})
            ratios[name].append(pair["muon"] / pair["adamw"])
            print(f"pair {i} {name}: adamw {pair['adamw']:.3f} s, muon {pair['muon']:.3f} s, ratio "
                  f"{ratios[name][-1]:.3f}", file=sys.stderr, flush=True)
    return {"runs": runs, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser("python -m benchmarks.muon_time", __doc__)
    ap.add_argument("--pairs", type=int, default=4, help="pairs of runs per layout")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of a run's median")
    ap.add_argument("--batch-size", type=int, default=4, help="micro-batch rows (T is 256)")
    ap.add_argument("--muon-adamw-lr", type=float, default=3e-3, help="max_lr of every run's AdamW")
    ap.add_argument("--out", default="muon_time", help="folder for the runs' configs, logs and muon_time.json")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.batch_size < 1 or not 0 <= args.skip < args.steps:
        raise UserError(f"--pairs={args.pairs} (>= 1), --batch-size={args.batch_size} (>= 1), --skip={args.skip} "
                        f"(0..steps-1): out of range")
    args.val_every = args.steps
    res = measure(args)
    Path(args.out, "muon_time.json").write_text(json.dumps(res, indent=1))
    print("| layout | Muon / AdamW step time, pair by pair | min | median | max |\n|---|---|---|---|---|")
    for name, r in res["ratios"].items():
        print(f"| {name} | {', '.join(f'{x:.2f}' for x in r)} | {min(r):.2f} | {statistics.median(r):.2f} | "
              f"{max(r):.2f} |")
    return 0


if __name__ == "__main__":
    run(main)
