"""CPU scaling through the real training command: `python cli.py fit` at TP=2 against TP=1, side by side.

    python -m benchmarks.scaling --batch-size 4 --seq-len 256 --pairs 3 --variant gpt_tp --variant benchmarks.fit:TorchRecipe
    python -m benchmarks.scaling --batch-size 2 --seq-len 1024 --compile --pairs 2

GPT-2 124M shapes (--model), fp32, one thread per process (OMP_NUM_THREADS=1), the bundled data sample, `--steps` optimizer
steps per run (no validation, no checkpoints). Each pair runs TP=1 (one process) and every TP=2 variant (two
processes, ModelParallel strategy) one after the other, the order reversed every other pair, so every side sees
the same machine load. A run's step time is the median over steps >= 2 of B x T / the logged
train/tokens_per_sec; its peak RSS is each process's high-water mark (VmHWM, polled from /proc), the largest
over its processes. Reported per variant: the TP=2 / TP=1 ratios of step time and of peak RSS, one per pair,
as min / median / max, and the TP=2 step time and peak RSS themselves. Goal (GPT-2 124M, 4 x 256, eager): step
ratio <= 0.60, peak-RSS ratio <= 0.60. A variant is gpt_tp (cli.py with TP_PLAN) or a plan module:attribute
(benchmarks.plans; run through `python -m benchmarks.fit --plan`), with an optional allocator suffix: @split (the
default) or @mmap list gpt_tp.train.malloc.HeapSplit with that policy, @glibc lists no callback. Its TP=1 side
runs cli.py with the same allocator.
"""

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


ALLOCATORS = ("split", "mmap", "glibc")  # gpt_tp.train.malloc.HeapSplit's policies, or no callback (glibc's own)


def parse_variant(text: str) -> tuple[str | None, str]:
    """"gpt_tp[@alloc]" or "module:attribute[@alloc]" -> (the plan's spec, None for gpt_tp's TP_PLAN; the
    allocator: split or mmap for gpt_tp.train.malloc.HeapSplit's policy, glibc for no callback), checked."""
    from benchmarks.fit import load

    spec, at, alloc = text.partition("@")
    alloc = alloc if at else "split"
    if alloc not in ALLOCATORS:
        raise UserError(f"--variant {text!r}: the suffix is the allocator, one of {', '.join('@' + a for a in ALLOCATORS)}")
    if spec == "gpt_tp":
        return None, alloc
    try:
        load(spec)
    except UserError as e:
        raise UserError(f"--variant {text!r}: {e} (give gpt_tp or a plan as module:attribute, e.g. "
                        "benchmarks.plans:ordered)") from None
    return spec, alloc


def tp1_side(alloc: str) -> str:
    """The name of the TP=1 side that runs with this allocator."""
    return "tp1" if alloc == "split" else f"tp1@{alloc}"


def fit_config(args, tp: int, alloc: str, run_dir: Path) -> dict:
    """The cli.py fit config of one run (JSON is YAML: cli.py --config reads it)."""
    strategy = "auto" if tp == 1 else {"class_path": "gpt_tp.checkpoint.ModelParallel",
                                       "init_args": {"data_parallel_size": 1, "tensor_parallel_size": tp}}
    callbacks = [] if alloc == "glibc" else [{"class_path": "gpt_tp.train.malloc.HeapSplit", "init_args": {"policy": alloc}}]
    return {
        "seed_everything": 1337,
        "trainer": {
            "accelerator": "cpu", "devices": tp, "strategy": strategy, "precision": "32-true",
            "max_steps": args.steps, "log_every_n_steps": 1, "limit_val_batches": 0, "num_sanity_val_steps": 0,
            "enable_checkpointing": False, "enable_progress_bar": False, "inference_mode": False,
            "gradient_clip_val": 1.0, "callbacks": callbacks,
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(run_dir), "name": "fit", "version": 0}}],
        },
        "model": {"model": args.model, "total_batch_size": None, "compile": args.compile,
                  "warmup_steps": 2},
        "data": {"data_dir": args.data_dir, "batch_size": args.batch_size, "seq_len": args.seq_len, "val_batches": 0},
    }


def _children(pid: int) -> list[int]:
    """pid and its descendants, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [c for c, p in parents.items() if p in frontier]
        tree += frontier
    return tree


def _hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def fit_once(args, tp: int, plan: str | None, alloc: str, run_dir: Path) -> dict:
    """One `python cli.py fit` run (`python -m benchmarks.fit --plan ...` for another plan): its step times and its
    processes' peak RSS."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "config.yaml"
    config.write_text(json.dumps(fit_config(args, tp, alloc, run_dir), indent=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = (run_dir / "output.txt").open("w")
    command = [str(ROOT / "cli.py")] if plan is None else ["-m", "benchmarks.fit", "--plan", plan]
    proc = subprocess.Popen([sys.executable, *command, "fit", "--config", str(config)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    hwm: dict[int, float] = {}
    while proc.poll() is None:
        for pid in _children(proc.pid)[1:] + [proc.pid]:
            if (mib := _hwm_mib(pid)) is not None and pid != os.getpid():
                hwm[pid] = max(hwm.get(pid, 0.0), mib)
        time.sleep(0.25)
    log.close()
    if proc.returncode != 0:
        tail = (run_dir / "output.txt").read_text()[-3000:]
        raise RuntimeError(f"cli.py fit (TP={tp}, {plan or 'gpt_tp'}) exited {proc.returncode}; its output ends:\n{tail}")
    rows = list(csv.DictReader((run_dir / "fit" / "version_0" / "metrics.csv").open()))
    tok_s = [float(r["train/tokens_per_sec"]) for r in rows if r.get("train/tokens_per_sec") and int(r["step"]) >= 2]
    step_s = [args.batch_size * args.seq_len / t for t in tok_s]
    return {"step_s": statistics.median(step_s), "steps_s": step_s, "peak_rss_mib": max(hwm.values())}


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def measure(args) -> dict:
    variants = [(v, *parse_variant(v)) for v in (args.variant or ["gpt_tp"])]
    # one TP=1 side per allocator in use; each TP=2 variant is paired with the TP=1 run of its allocator
    sides = [(tp1_side(a), 1, None, a) for a in sorted({v[2] for v in variants})]
    sides += [(name, 2, plan, a) for name, plan, a in variants]
    out = Path(args.out)
    runs = {name: [] for name, *_ in sides}
    for i in range(args.pairs):
        for name, tp, plan, alloc in (sides if i % 2 == 0 else sides[::-1]):
            r = fit_once(args, tp, plan, alloc, out / f"pair{i}" / name.replace(":", "_").replace("@", "_").replace(".", "_"))
            runs[name].append(r)
            print(f"pair {i}  {name:<16} step {r['step_s']:.3f} s  peak RSS {r['peak_rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
    tp1 = {name: {"step_s": stats([r["step_s"] for r in runs[name]]),
                  "peak_rss_mib": stats([r["peak_rss_mib"] for r in runs[name]])} for name, tp, *_ in sides if tp == 1}
    res = {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "pairs": args.pairs,
           "compile": args.compile, "tp1": tp1, "variants": {}, "runs": runs}
    for name, tp, _, alloc in sides:
        if tp == 1:
            continue
        pairs = list(zip(runs[tp1_side(alloc)], runs[name]))
        res["variants"][name] = {
            "step_ratio": stats([b["step_s"] / a["step_s"] for a, b in pairs]),
            "rss_ratio": stats([b["peak_rss_mib"] / a["peak_rss_mib"] for a, b in pairs]),
            "step_s": stats([b["step_s"] for _, b in pairs]),
            "peak_rss_mib": stats([b["peak_rss_mib"] for _, b in pairs]),
        }
    return res


def markdown(res: dict) -> str:
    f = lambda s, d=3: "/".join(f"{s[k]:.{d}f}" for k in ("min", "median", "max"))  # noqa: E731
    head = (f"{res['model']}, micro-batch {res['batch_size']} x {res['seq_len']}, fp32, "
            f"{'compiled blocks' if res['compile'] else 'eager'}, 1 thread per process, {res['steps']} steps per run, "
            f"{res['pairs']} interleaved pairs (min/median/max over pairs)\n\n")
    for name, t in res["tp1"].items():
        head += f"{name}: step {f(t['step_s'], 2)} s, peak RSS {f(t['peak_rss_mib'], 0)} MiB\n"
    lines = ["| TP=2 variant | step ratio TP=2/TP=1 | TP=2 step s | peak-RSS ratio | TP=2 peak RSS MiB |", "|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        lines.append(f"| {name} | {f(v['step_ratio'])} | {f(v['step_s'], 2)} | {f(v['rss_ratio'])} | {f(v['peak_rss_mib'], 0)} |")
    return head + "\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser("python -m benchmarks.scaling", __doc__)
    ap.add_argument("--model", default="gpt2", help="a named size (gpt_tp.model.SIZES)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256, help="even (sequence parallelism splits it), <= 1024")
    ap.add_argument("--steps", type=int, default=7, help="optimizer steps per run; steps >= 2 are timed")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved rounds of TP=1 and every TP=2 variant")
    ap.add_argument("--variant", action="append", help="TP=2 side: gpt_tp or a plan module:attribute, with an "
                    "optional @split, @mmap or @glibc allocator; repeatable (default: gpt_tp)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (both sides)")
    ap.add_argument("--data-dir", default="data/sample")
    ap.add_argument("--out", default="scaling_out", help="folder for the runs' configs and logs, and scaling.json")
    args = ap.parse_args(argv)
    if args.seq_len % 2 or not 0 < args.seq_len <= 1024:
        raise UserError(f"--seq-len={args.seq_len} must be even and in 2..1024")
    if args.batch_size < 1 or args.pairs < 1 or args.steps < 3:
        raise UserError(f"--batch-size={args.batch_size}, --pairs={args.pairs}: need >= 1; --steps={args.steps}: need >= 3")
    from gpt_tp.model import SIZES

    if args.model not in SIZES:
        raise UserError(f"--model={args.model!r}: use one of {', '.join(SIZES)}")
    for v in args.variant or []:
        parse_variant(v)
    res = measure(args)
    (Path(args.out) / "scaling.json").write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    run(main)
