"""Train the tiny GPT on the bundled sample with distributed checkpoints; optionally resume, die mid-save, or
fail a save's fsync.

Rank 0 writes <out>.json: {"losses": {step: train/loss}, "last": the checkpoint 'last' points to}.

Several runs of one world size, one after another in the same processes (one launch instead of one each): their
argument lists joined by `--then`; each builds its own Trainer, data, seeds (seed_everything first) and model as a
fresh process would, so a resume still has only its checkpoint to go on (never the memory of the run that saved it,
which ran in another launch). None may die or fail on purpose.
"""

import argparse
import errno
import json
import os
import signal
import time

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from gpt_tp.entry import run
from runs import split_runs
from stop_at import StopAt  # the run stops at --steps of the 12-step schedule every run shares
from gpt_tp.checkpoint import ModelParallel
from gpt_tp.train.datamodule import GPTDataModule
from gpt_tp.model import GPTConfig
from gpt_tp.train.malloc import HeapSplit
from gpt_tp.train.module import GPTModule
from gpt_tp.train.optim import AdamW, Muon


class Record(Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "train/loss" in trainer.callback_metrics:
            self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])


def die_on_save(n: int) -> None:
    """Kill this whole process group with SIGKILL inside the n-th checkpoint save, after the shards are written
    and before the save completes: what a preempted node or an OOM kill does to a run."""
    import lightning.pytorch.strategies.model_parallel as mp

    original, calls = mp._distributed_checkpoint_save, [0]

    def save(state, path):
        original(state, path)
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    mp._distributed_checkpoint_save = save


def die_on_aside(n: int) -> None:
    """SIGKILL this process right after the n-th checkpoint it moves aside to `<name>.old` to overwrite the name,
    before the new folder is renamed in: the one moment a checkpoint name holds nothing."""
    original, calls = os.rename, [0]

    def rename(src, dst, *args, **kwargs):
        original(src, dst, *args, **kwargs)
        if str(dst).endswith(".old"):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

    os.rename = rename


def fail_fsync(stamp: str) -> None:
    """Rank 0's fsync of the first checkpoint fails (a full or broken disk); the time it fails goes to `stamp`."""
    import gpt_tp.checkpoint.store as ckpt

    def broken(path):
        with open(stamp, "w") as f:
            f.write(str(time.time()))
        raise OSError(errno.EIO, "Input/output error (injected)", str(path))

    if int(os.environ.get("RANK", "0")) == 0:
        ckpt._fsync = broken


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=4, help="per data-parallel rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--accum", type=int, default=1, help="trainer.accumulate_grad_batches")
    ap.add_argument("--save-last", choices=["link", "copy"], default="link")
    ap.add_argument("--save-top-k", type=int, default=2)
    ap.add_argument("--no-version-counter", action="store_true", help="a rerun saves over the same step names")
    ap.add_argument("--die-on-save", type=int, default=0)
    ap.add_argument("--die-on-aside", type=int, default=0)
    ap.add_argument("--fail-fsync", default=None, help="rank 0's fsync fails; the time it failed goes to this file")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"), help="model.optimizer: AdamW or Muon")
    ap.add_argument("--muon-fp32", action="store_true", help="Muon's fp32: Newton-Schulz in float32")
    ap.add_argument("--heap-split", action="store_true", help="list gpt_tp.train.malloc.HeapSplit (configs/cpu.yaml's)")
    ap.add_argument("--out", required=True)
    return ap


def main():
    runs = [parser().parse_args(argv) for argv in split_runs()]
    if len(runs) > 1:
        assert not any(a.die_on_save or a.die_on_aside or a.fail_fsync for a in runs), "one run per launch"
    for args in runs:
        fit(args)


def fit(args) -> None:
    if args.die_on_save:
        die_on_save(args.die_on_save)
    if args.die_on_aside:
        die_on_aside(args.die_on_aside)
    if args.fail_fsync:
        fail_fsync(args.fail_fsync)
    world = args.tp * args.dp
    ckpt = ModelCheckpoint(
        dirpath=args.ckpt_dir, filename="step{step:04d}", auto_insert_metric_name=False, every_n_train_steps=2,
        save_top_k=args.save_top_k, monitor="step", mode="max", save_last="link" if args.save_last == "link" else True,
        enable_version_counter=not args.no_version_counter,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=ModelParallel(data_parallel_size=args.dp, tensor_parallel_size=args.tp),
        max_steps=12, accumulate_grad_batches=args.accum, gradient_clip_val=1.0, inference_mode=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, log_every_n_steps=1,
        callbacks=[rec := Record(), ckpt, StopAt(args.steps), *([HeapSplit()] if args.heap_split else [])],
    )
    L.seed_everything(1234, verbose=False)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=args.n_embd, block_size=64, dropout=args.dropout)
    model = GPTModule(config, max_lr=3e-3, min_lr=3e-4, warmup_steps=2, max_steps=12, total_batch_size=None,
                      optimizer=Muon(fp32=args.muon_fp32) if args.optimizer == "muon" else AdamW())
    data = GPTDataModule("data/sample", batch_size=args.batch_size, seq_len=64, val_batches=0)
    trainer.fit(model, data, ckpt_path=args.resume)
    if trainer.global_rank == 0:
        with open(args.out + ".json", "w") as f:
            json.dump({"losses": rec.losses, "last": os.path.realpath(os.path.join(args.ckpt_dir, "last.ckpt"))}, f)


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
