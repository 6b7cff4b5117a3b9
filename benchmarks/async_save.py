"""Training time lost per checkpoint save, synchronous vs asynchronous (trainer.strategy.init_args.async_save), through
`python cli.py fit` at TP=2 on CPU, on a model whose checkpoint is about 1 GB (configs/cpu.yaml with 6 blocks of
768), saving every `--every` steps; and the resident memory each run peaked at (the staging copy's cost).

    python -m benchmarks.async_save --steps 24 --every 6 --repeat 3

Each round runs the three modes one after another (no saves, sync, async). The stall of a save is the time the
training loop spent blocked inside the strategy's save_checkpoint and finish_save (staging, waiting, committing):
the saves before the final step are the ones training waits for; the final step's save is waited for by both modes
at the run's end, and is reported apart. Lost per save end to end = (the run's time from its first step's end to
its teardown) minus the same in the run without saves, over the number of saves. On a CPU the background write
shares the cores with training; on a GPU it does not. StepClock records the times."""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
MODEL = ("--model.model.n_layer", "6", "--model.model.n_head", "12", "--model.model.n_embd", "768",
         "--model.model.block_size", "64", "--data.batch_size", "1", "--data.seq_len", "64", "--model.total_batch_size", "null")


class StepClock(Callback):
    """Rank 0 appends the wall time of each optimizer step's end to `path` (JSON list, written at the run's end)."""

    def __init__(self, path: str):
        self.path, self.times, self.stalls = path, [], []  # stalls: [global_step, seconds] per outermost call

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Time the training loop spends inside the strategy's save and commit (the stall it sees)."""
        strategy, depth = trainer.strategy, [0]
        for name in ("save_checkpoint", "finish_save"):
            def timed(*args, _call=getattr(strategy, name), **kwargs):
                start, depth[0] = time.perf_counter(), depth[0] + 1
                try:
                    return _call(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    if not depth[0]:  # the outermost call's
                        self.stalls.append([trainer.global_step, time.perf_counter() - start])
            setattr(strategy, name, timed)

    def on_train_batch_end(self, trainer, *args) -> None:
        self.times.append(time.perf_counter())

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.times.append(time.perf_counter())  # after the final save, and its commit (the strategy's on_train_end)
        if trainer.is_global_zero:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            Path(self.path).write_text(json.dumps({"times": self.times, "peak_rss": peak, "stalls": self.stalls}))


def fit(tmp: Path, mode: str, steps: int, every: int) -> dict:
    clock = tmp / f"{mode}.json"
    saves = ["--trainer.enable_checkpointing", "false"] if mode == "none" else [
        "--trainer.callbacks+=gpt_tp.checkpoint.AtomicModelCheckpoint", f"--trainer.callbacks.dirpath={tmp / mode}",
        f"--trainer.callbacks.every_n_train_steps={every}", "--trainer.callbacks.save_top_k=2",
        "--trainer.callbacks.monitor=step", "--trainer.callbacks.mode=max", "--trainer.callbacks.save_last=link"]
    args = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(ROOT / "configs" / "cpu.yaml"), *MODEL,
            "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(10 * steps), "--trainer.logger", "false",
            "--trainer.callbacks", "benchmarks.async_save.StepClock", "--trainer.callbacks.path", str(clock), *saves,
            "--trainer.strategy.init_args.async_save", str(mode == "async").lower()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(clock.read_text())


def spread(xs: list[float], fmt: str = ".2f") -> str:
    xs = sorted(xs)
    return "/".join(format(x, fmt) for x in (xs[0], xs[len(xs) // 2], xs[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    saves = args.steps // args.every  # the final step is a periodic one
    if args.steps % args.every or saves < 2:
        sys.exit("--steps must be a multiple of --every, with at least two saves")
    rows = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            runs = {mode: fit(Path(tmp), mode, args.steps, args.every) for mode in ("none", "sync", "async")}
        row = {"span_none": runs["none"]["times"][-1] - runs["none"]["times"][0], "rss_none": runs["none"]["peak_rss"]}
        for mode in ("sync", "async"):
            r = runs[mode]
            row[mode] = {"during": sum(t for s, t in r["stalls"] if s < args.steps) / (saves - 1),
                         "final": sum(t for s, t in r["stalls"] if s >= args.steps),
                         "lost": (r["times"][-1] - r["times"][0] - row["span_none"]) / saves, "rss": r["peak_rss"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{args.repeat} rounds, {saves} saves each (steps {args.steps}, every {args.every}), min/median/max:")
    for mode in ("sync", "async"):
        print(f"  {mode}: training stalled {spread([r[mode]['during'] for r in rows])} s per save before the final "
              f"step; the final save {spread([r[mode]['final'] for r in rows])} s; lost end to end "
              f"{spread([r[mode]['lost'] for r in rows])} s per save; rank 0 peak RSS "
              f"{spread([r[mode]['rss'] / 2**30 for r in rows])} GiB")
    print(f"  without saves: rank 0 peak RSS {spread([r['rss_none'] / 2**30 for r in rows])} GiB")
    print(f"  async stall / sync stall, per round: {spread([r['async']['during'] / r['sync']['during'] for r in rows], '.3f')}")


if __name__ == "__main__":
    main()
