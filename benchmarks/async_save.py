"""Training time lost per checkpoint save, synchronous vs asynchronous (trainer.strategy.init_args.async_save), through
`python cli.py fit` at TP=2 on CPU, on a model whose checkpoint is about 1 GB (configs/cpu.yaml with 6 blocks of
768), saving every `--every` steps; and the resident memory each run peaked at (the staging copy's cost).

    python -m benchmarks.async_save --steps 24 --every 6

Each mode runs once (no saves, sync, async): lost per save end to end = (the run's time from its first step's end to
its teardown) minus the same in the run without saves, over the number of saves; and the time the training loop
spent blocked inside the strategy's save_checkpoint and finish_save (staging, waiting, committing), per save. On a
CPU the background write shares the cores with training; on a GPU it does not. StepClock records the times."""

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
        self.path, self.times, self.blocked = path, [], 0.0

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
                    self.blocked += 0.0 if depth[0] else time.perf_counter() - start  # the outermost call's
            setattr(strategy, name, timed)

    def on_train_batch_end(self, trainer, *args) -> None:
        self.times.append(time.perf_counter())

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.times.append(time.perf_counter())  # after the final save, and its commit (the strategy's on_train_end)
        if trainer.is_global_zero:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            Path(self.path).write_text(json.dumps({"times": self.times, "peak_rss": peak, "blocked": self.blocked}))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {mode: fit(Path(tmp), mode, args.steps, args.every) for mode in ("none", "sync", "async")}
    span = {m: r["times"][-1] - r["times"][0] for m, r in runs.items()}
    saves = args.steps // args.every  # the first step's end is before any save; the final step is a periodic one
    for mode in ("sync", "async"):
        print(f"{mode}: {(span[mode] - span['none']) / saves:.2f} s lost per save end to end ({saves} saves; run "
              f"{span[mode]:.1f} s, without saves {span['none']:.1f} s); the loop blocked in saves and commits "
              f"{runs[mode]['blocked'] / saves:.2f} s per save; rank 0 peak RSS {runs[mode]['peak_rss'] / 2**30:.2f} GiB "
              f"(without saves {runs['none']['peak_rss'] / 2**30:.2f} GiB)")

if __name__ == "__main__":
    main()
