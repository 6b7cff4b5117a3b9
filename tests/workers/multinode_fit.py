"""Train the tiny GPT at DP x TP through Lightning's own launcher, on one "node" or on several: started once per
node with NODE_RANK, MASTER_ADDR and MASTER_PORT set (Lightning's multi-node environment), each start spawning
--devices processes; or once per task by srun (Lightning's SLURM environment). Rank 0 writes <out>.json: the per-step losses and, for every rank, its node, its TP group and
its DP group (global ranks, from the device mesh Lightning built)."""

import argparse
import json
import os

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from gpt_tp.entry import run
from gpt_tp.train.module import GPTModule
from synthetic_data import SyntheticDataModule


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(self.losses) < trainer.global_step:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--devices", type=int, required=True, help="processes per node")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = args.nodes * args.devices
    dp = world // args.tp
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.nodes,
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.tp),
        max_steps=args.steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, log_every_n_steps=1,
        callbacks=[rec := Losses()],
    )
    L.seed_everything(1234, verbose=False)
    global_batch, T = 4, 32
    model = GPTModule("tiny", max_lr=3e-3, min_lr=3e-4, warmup_steps=2, max_steps=args.steps,
                      total_batch_size=global_batch * T, meta_init=True)
    trainer.fit(model, SyntheticDataModule(batch_size=global_batch // dp, seq_len=T, vocab=1024, seed=7))
    mesh = trainer.strategy.device_mesh
    me = {
        "rank": dist.get_rank(), "node_rank": trainer.node_rank, "local_rank": trainer.local_rank, "pid": os.getpid(),
        "env_node_rank": int(os.environ.get("NODE_RANK", os.environ.get("SLURM_NODEID", -1))),  # Lightning's or srun's
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "tp_group": dist.get_process_group_ranks(mesh["tensor_parallel"].get_group()),
        "dp_group": dist.get_process_group_ranks(mesh["data_parallel"].get_group()),
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, me)
    if trainer.global_rank == 0:
        with open(args.out + ".json", "w") as f:
            json.dump({"losses": rec.losses, "ranks": ranks}, f, indent=1)


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
