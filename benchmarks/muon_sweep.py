"""AdamW against Muon through the real training command, each at the best of a 3-value lr sweep, on CPU.

    python -m benchmarks.muon_sweep --steps 120 --out muon_out

`python cli.py fit` at TP=2 (two processes, one thread each, fp32) on the bundled sample, a GPT whose blocks are
not dwarfed by the 50k-vocabulary embedding (4 layers, 4 heads, n_embd 256, T 256), micro-batch 4, validation
every --val-every steps on 4 batches. AdamW sweeps model.max_lr over --adamw-lrs; Muon sweeps model.optimizer.lr over
--muon-lrs with AdamW (on the embeddings, LayerNorms and biases) at --muon-adamw-lr. The runs alternate between
the two optimizers so each sees the same machine load. A run's wall time at step s is the sum of its step times
(B x T / the logged train/tokens_per_sec) up to s. Reported: each run's val losses; for each optimizer's best run
(lowest last val loss) the val loss at each validation step; the Muon / AdamW ratio of the median step time within
each pair of runs that ran one after the other (the same machine load).
"""

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256, "vocab_size": 50304}


def fit_config(args, optimizer: str, lr: float, run_dir: Path, dp: int = 1, spec: dict | None = None) -> dict:
    """The cli.py fit config of one run on 2 processes, DP=dp x TP=2/dp (JSON is YAML: cli.py --config reads it);
    spec: another Muon class's --model.optimizer (class_path, init_args) in place of gpt_tp's Muon at `lr`."""
    model = {"model": MODEL, "total_batch_size": None, "warmup_steps": args.steps // 10}
    model |= {"max_lr": lr, "min_lr": lr / 10} if optimizer == "adamw" else {
        "optimizer": spec or {"class_path": "gpt_tp.train.optim.Muon", "init_args": {"lr": lr}},
        "max_lr": args.muon_adamw_lr, "min_lr": args.muon_adamw_lr / 10}
    return {
        "seed_everything": 1337,
        "trainer": {
            "accelerator": "cpu", "devices": 2, "precision": "32-true", "max_steps": args.steps,
            "strategy": {"class_path": "gpt_tp.checkpoint.ModelParallel",
                         "init_args": {"data_parallel_size": dp, "tensor_parallel_size": 2 // dp}},
            "log_every_n_steps": 1, "val_check_interval": args.val_every, "check_val_every_n_epoch": None,
            "num_sanity_val_steps": 0, "enable_checkpointing": False, "enable_progress_bar": False,
            "inference_mode": False, "gradient_clip_val": 1.0,
            "callbacks": [{"class_path": "gpt_tp.train.malloc.HeapSplit", "init_args": {"policy": "split"}}],
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(run_dir), "name": "fit", "version": 0}}],
        },
        "model": model,
        "data": {"data_dir": "data/sample", "batch_size": args.batch_size, "seq_len": 256, "val_batches": 4},
    }


def fit_once(args, optimizer: str, lr: float, run_dir: Path, dp: int = 1, spec: dict | None = None) -> dict:
    """One `python cli.py fit` run: its val losses by step, its step times (s, by step) and their median."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "config.yaml"
    config.write_text(json.dumps(fit_config(args, optimizer, lr, run_dir, dp, spec), indent=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with (run_dir / "output.txt").open("w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(config)], cwd=ROOT,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (run_dir / "output.txt").read_text()[-3000:]
        raise RuntimeError(f"cli.py fit ({optimizer}, lr {lr}) exited {proc.returncode}; its output ends:\n{tail}")
    rows = list(csv.DictReader((run_dir / "fit" / "version_0" / "metrics.csv").open()))
    step_s = {int(r["step"]): args.batch_size * 256 * dp / float(r["train/tokens_per_sec"])
              for r in rows if r.get("train/tokens_per_sec")}
    val = {int(r["step"]) + 1: float(r["val/loss"]) for r in rows if r.get("val/loss")}
    wall = {s: sum(t for k, t in step_s.items() if k < s) for s in val}
    return {"optimizer": optimizer, "lr": lr, "val": val, "wall_s": wall, "step_s": step_s,
            "median_step_s": statistics.median(step_s.values())}


def measure(args) -> dict:
    sweeps = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    runs = []
    for i in range(3):  # alternate: adamw, muon, muon, adamw, adamw, muon
        for opt in (("adamw", "muon") if i % 2 == 0 else ("muon", "adamw")):
            r = fit_once(args, opt, sweeps[opt][i], Path(args.out) / f"{opt}_{sweeps[opt][i]:g}")
            runs.append(r)
            print(f"{opt} lr {r['lr']:g}: val {r['val']}, median step {r['median_step_s']:.3f} s", file=sys.stderr,
                  flush=True)
    best = {opt: min((r for r in runs if r["optimizer"] == opt), key=lambda r: r["val"][max(r["val"])])
            for opt in sweeps}
    return {"runs": runs, "best": best, "step_time_ratios_muon_over_adamw": step_time_ratios(runs)}


def step_time_ratios(runs: list[dict]) -> list[float]:
    """Muon's median step time over AdamW's, for each pair of runs made one after the other."""
    pairs = [sorted(pair, key=lambda r: r["optimizer"]) for pair in zip(runs[0::2], runs[1::2])]
    return [m["median_step_s"] / a["median_step_s"] for a, m in pairs]


def markdown(res: dict) -> str:
    lines = ["| run | lr | " + " | ".join(f"val @ {s}" for s in sorted(res["runs"][0]["val"])) + " | median step s |",
             "|---|---|" + "---|" * (len(res["runs"][0]["val"]) + 1)]
    for r in res["runs"]:
        mark = " (best)" if r is res["best"][r["optimizer"]] else ""
        lines.append(f"| {r['optimizer']}{mark} | {r['lr']:g} | " + " | ".join(
            f"{r['val'][s]:.3f}" for s in sorted(r["val"])) + f" | {r['median_step_s']:.3f} |")
    a, m = res["best"]["adamw"], res["best"]["muon"]
    lines.append("")
    ratios = ", ".join(f"{x:.2f}" for x in res["step_time_ratios_muon_over_adamw"])
    lines.append(f"val loss at the last step, best Muon / best AdamW: {m['val'][max(m['val'])]:.3f} / "
                 f"{a['val'][max(a['val'])]:.3f}; step time Muon / AdamW, pair by pair: {ratios}")
    return "\n".join(lines)


def run_arguments(ap: ArgumentParser, steps: int, val_every: int) -> None:
    """The flags of a sweep's runs (fit_config reads them)."""
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps per run")
    ap.add_argument("--val-every", type=int, default=val_every, help="validate every this many steps")
    ap.add_argument("--batch-size", type=int, default=4, help="micro-batch rows (T is 256)")
    ap.add_argument("--muon-adamw-lr", type=float, default=3e-3, help="max_lr of AdamW's part in the Muon runs")


def checked(args):
    if args.steps < 2 or args.batch_size < 1 or not 1 <= args.val_every <= args.steps:
        raise UserError(f"--steps={args.steps} (>= 2), --batch-size={args.batch_size} (>= 1), --val-every="
                        f"{args.val_every} (1..steps): out of range")
    return args


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser("python -m benchmarks.muon_sweep", __doc__)
    run_arguments(ap, steps=120, val_every=30)
    ap.add_argument("--adamw-lrs", type=float, nargs=3, default=[1e-3, 3e-3, 1e-2], help="AdamW's max_lr sweep")
    ap.add_argument("--muon-lrs", type=float, nargs=3, default=[0.01, 0.02, 0.05], help="Muon's lr sweep (model.optimizer.lr)")
    ap.add_argument("--out", default="muon_out", help="folder for the runs' configs, logs and muon_sweep.json")
    args = checked(ap.parse_args(argv))
    res = measure(args)
    Path(args.out, "muon_sweep.json").write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    run(main)
