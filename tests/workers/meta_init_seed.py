"""Meta-device init at TP=world with a different random state on every rank (what unseeded processes have).

Each rank builds the tiny GPT on the meta device after torch.manual_seed(100 + rank), parallelizes it and
materializes its shards; the gathered parameters are compared, on rank 0, with the eager single-device build
from rank 0's random state. Rank 0 writes <out>.json: {"mismatched": [parameter names]}.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gpt_tp.entry import run
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.parallel import materialize, parallelize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(100 + rank)
    with torch.device("meta"):
        model = GPT(config)
    parallelize(model, mesh)
    materialize(model, torch.device("cpu"))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.manual_seed(100)
        eager = dict(GPT(config).named_parameters())
        mismatched = [n for n, t in full.items() if not torch.equal(t, eager[n])]
        with open(args.out + ".json", "w") as f:
            json.dump({"mismatched": mismatched, "compared": len(full), "world": world}, f)


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
