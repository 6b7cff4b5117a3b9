"""How a distributed command ends (gpt_tp.entry.run) under torchrun: --mode ok runs a DTensor op and returns;
--mode user-error raises the same UserError on every rank; --mode one-rank raises on rank 1 only.

Each rank prints the gloo threads still alive after destroy_process_group (DTensor's plan cache keeps the mesh's
groups), and registers an atexit hook that prints "interpreter shutdown": run() must leave without it."""

import argparse
import atexit
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from gpt_tp.entry import run
from gpt_tp.errors import UserError


def gloo_threads() -> list[str]:
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ok", "user-error", "one-rank"], default="ok")
    args = ap.parse_args()
    atexit.register(lambda: print(f"rank {os.environ['RANK']}: interpreter shutdown", flush=True))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    total = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]).sum().full_tensor()
    if args.mode == "user-error" or (args.mode == "one-rank" and dist.get_rank() == 1):
        raise UserError("data.seq_len=9 is wrong: set it to 8")
    dist.destroy_process_group()
    print(f"rank {os.environ['RANK']}: sum {total.item():.0f}; gloo threads after destroy_process_group: {gloo_threads()}", flush=True)


if __name__ == "__main__":
    run(main)
