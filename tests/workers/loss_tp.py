"""gpt_tp.parallel.loss.cross_entropy on vocab-sharded DTensor logits (TP=2, gloo) against torch's loss on the full logits."""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from gpt_tp.entry import run
from gpt_tp.parallel.loss import cross_entropy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # the same full logits and targets on every rank
    B, T, V = 2, 8, 96
    full = (torch.randn(B, T, V) * 3).requires_grad_()
    y = torch.randint(0, V, (B, T))
    y[0, 0], y[1, 1] = 0, V - 1  # targets in the first and the last shard
    ref = F.cross_entropy(full.flatten(0, 1), y.flatten())
    ref.backward()

    logits = distribute_tensor(full.detach(), mesh, [Shard(2)]).requires_grad_()
    with CommDebugMode() as fwd:
        loss = cross_entropy(logits, y)
    with CommDebugMode() as bwd:
        loss.backward()
    res = {
        "rank": dist.get_rank(),
        "loss": loss.item(),
        "ref": ref.item(),
        "loss_is_plain": not hasattr(loss, "placements"),
        "grad_placements": str(logits.grad.placements),
        "grad_diff": (logits.grad.full_tensor() - full.grad).abs().max().item(),
        "fwd_comms": {str(k).split(".")[-1]: v for k, v in fwd.get_comm_counts().items()},
        "bwd_comms": sum(bwd.get_comm_counts().values()),
    }
    try:
        cross_entropy(distribute_tensor(full.detach(), mesh, [Replicate()]), y)
        res["replicate_error"] = None
    except ValueError as e:
        res["replicate_error"] = str(e)
    with open(f"{args.out}.{dist.get_rank()}.json", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
