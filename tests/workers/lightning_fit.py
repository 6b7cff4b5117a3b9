"""Train the tiny GPT through Lightning's Trainer, single-device or under torchrun with ModelParallelStrategy.

Writes <out>.json on rank 0: per-optimizer-step train/loss, train/grad_norm, train/lr, the gathered initial
and final parameters' checksums, and (with --dump) the gathered parameters themselves to <out>.pt.

Several runs of one world size, one after another in the same processes (one launch instead of one each): their
argument lists joined by `--then` (`--out a --tp 2 --then --out b --tp 2 --compile`). Each run builds its own Trainer,
seeds and model as a fresh process would; torch.compile's in-memory caches are reset between runs.
"""

import argparse
import contextlib
import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

import gpt_tp
from gpt_tp.cli.simulate import CollectiveCounts
from gpt_tp.cluster.slurm import Preemption
from gpt_tp.entry import run
from gpt_tp.train.logs import HeldCSVLogger, LogWriteCheck
from runs import split_runs
from gpt_tp.parallel import clip_grad_norm, grad_norm
from gpt_tp.train.module import GPTModule
from synthetic_data import SyntheticDataModule

PACKAGE = os.path.dirname(gpt_tp.__file__)


def gathered(module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for n, p in module.model.named_parameters()}


class Record(Callback):
    def __init__(self):
        self.rows, self.init = [], None

    def on_train_start(self, trainer, pl_module):
        self.init = gathered(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        if len(self.rows) < trainer.global_step and "train/loss" in m:
            self.rows.append({k: float(m[k]) for k in ("train/loss", "train/grad_norm", "train/lr")})


class GradProbe(Callback):
    """A user's callback reading every gradient in on_before_optimizer_step (Lightning runs it before GPTModule's):
    the gathered gradients of the first `steps` optimizer steps, and whether grad_norm and clip_grad_norm, called
    twice, change the norm or a gradient."""

    def __init__(self, steps: int = 2):
        self.steps, self.grads, self.pure = steps, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step >= self.steps:
            return
        model = pl_module.model
        full = lambda g: (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()  # noqa: E731
        before = {n: full(p.grad) for n, p in model.named_parameters()}
        norms = [float(grad_norm(model)), float(grad_norm(model)),
                 float(clip_grad_norm(model, 1e9)), float(clip_grad_norm(model, 1e9))]
        after = {n: full(p.grad) for n, p in model.named_parameters()}
        self.grads.append(before)
        self.pure.append({"norms": norms, "grads_unchanged": all(torch.equal(before[n], after[n]) for n in before)})


class StepComms(Callback):
    """--comms: each optimizer step's collectives by process group and gpt_tp's host syncs (its calls of Tensor.item,
    tolist, __bool__, __float__, __int__; Lightning's logging makes its own), counted from the start of its first
    micro-batch to the start of the next step (so the callbacks' hooks around the step are inside); first in the
    callbacks, so it opens and closes before theirs."""

    SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self):
        self.steps, self._mode, self._syncs = [], None, 0
        self._real = {name: getattr(torch.Tensor, name) for name in self.SYNCS}

    def _counted(self, name):
        def call(t, *args, **kwargs):
            self._syncs += sys._getframe(1).f_code.co_filename.startswith(PACKAGE)
            return self._real[name](t, *args, **kwargs)
        return call

    def _close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            for name, real in self._real.items():
                setattr(torch.Tensor, name, real)
            counts = {f"{group} {kind}": n for (group, kind), n in sorted(self._mode.counts.items())}
            self.steps.append({"collectives": counts, "host_syncs": self._syncs})
            self._mode = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._close()
            labels, mesh = {}, pl_module.device_mesh
            if mesh is not None:
                labels = {torch.distributed.group.WORLD.group_name: "world"}
                labels |= {mesh.get_group(d).group_name: d for d in mesh.mesh_dim_names}
            self._mode, self._syncs = CollectiveCounts(labels).__enter__(), 0
            for name in self.SYNCS:
                setattr(torch.Tensor, name, self._counted(name))

    def on_train_end(self, trainer, pl_module):
        self._close()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--meta", action="store_true", help="GPTModule(meta_init=True)")
    ap.add_argument("--init-module", action="store_true", help="build under trainer.init_module(empty_init=True)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ac", default="none", help="GPTModule(activation_checkpointing=...)")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--val-batches", type=int, default=0, help="validate this many batches after the last step")
    ap.add_argument("--strategy", choices=("model_parallel", "ddp"), default="model_parallel", help="for more than one process")
    ap.add_argument("--grads", action="store_true", help="GradProbe: the gradients a callback reads, to <out>.grads.pt")
    ap.add_argument("--comms", action="store_true", help="StepComms, with the callbacks cli.py adds to a run that "
                    "share the step's all-reduce (Preemption, LogWriteCheck, a HeldCSVLogger)")
    ap.add_argument("--out", required=True)
    return ap


def main():
    for i, run_argv in enumerate(split_runs()):
        if i:
            torch._dynamo.reset()  # the next run compiles afresh, as in a process of its own
        fit(parser().parse_args(run_argv))


def fit(args) -> None:
    world = args.tp * args.dp
    assert world == int(os.environ.get("WORLD_SIZE", 1)), (world, os.environ.get("WORLD_SIZE"))
    strategy = ModelParallelStrategy(data_parallel_size=args.dp, tensor_parallel_size=args.tp) if world > 1 else "auto"
    if args.strategy == "ddp":
        assert args.tp == 1, "DDP replicates the whole model: --tp 1"
        strategy = "ddp"
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=world, strategy=strategy, max_steps=args.steps,
        accumulate_grad_batches=args.accum, gradient_clip_val=1.0, inference_mode=False,
        logger=HeldCSVLogger(args.out + "_logs") if args.comms else False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=args.val_batches, log_every_n_steps=1, check_val_every_n_epoch=None,
        val_check_interval=args.steps * args.accum if args.val_batches else None, callbacks=[*([comms := StepComms(), Preemption(None, None), LogWriteCheck()] if args.comms else []), rec := Record(),
                   *([probe := GradProbe()] if args.grads else [])], precision=args.precision,
    )
    L.seed_everything(1234, verbose=False)
    global_batch = 4
    B, T = global_batch // args.dp, 32
    with trainer.init_module(empty_init=True) if args.init_module else contextlib.nullcontext():
        model = GPTModule(
            "tiny", max_lr=3e-3, min_lr=3e-4, warmup_steps=2, max_steps=args.steps,
            total_batch_size=global_batch * T * args.accum, meta_init=args.meta, compile=args.compile,
            activation_checkpointing=args.ac,
        )
    assert not args.init_module or all(p.is_meta for p in model.parameters())
    data = SyntheticDataModule(batch_size=B, seq_len=T, vocab=1024, seed=7)
    trainer.fit(model, data)
    final = gathered(model)
    if trainer.global_rank == 0:
        with open(args.out + ".json", "w") as f:
            val = trainer.callback_metrics.get("val/loss")
            json.dump({"steps": comms.steps if args.comms else None, "rows": rec.rows, "fused": model.optimizers().optimizer.defaults["fused"], "val_loss": None if val is None else float(val)}, f)
        torch.save({"init": rec.init, "final": final}, args.out + ".pt")
        if args.grads:
            torch.save({"grads": probe.grads, "pure": probe.pure}, args.out + ".grads.pt")


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
