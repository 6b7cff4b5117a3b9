"""Run under torchrun (gloo, CPU): the collectives of one full training step of the tiny GPT on a (dp, tp) mesh
(TP -> FSDP2, fused AdamW, clip 1.0), by phase and kind and by process group, next to gpt_tp.perf.audit's derived
minimum. Rank 0 writes them to --out as JSON."""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gpt_tp.perf.audit import minimum_collectives, step_collectives
from gpt_tp.perf.bench import groups_of
from gpt_tp.entry import run
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.train.optim import make_adamw
from gpt_tp.parallel import parallelize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    dp = args.dp
    tp = dist.get_world_size() // dp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    config = GPTConfig.from_name("tiny", n_layer=args.layers)
    torch.manual_seed(0)
    model = parallelize(GPT(config), mesh)
    x = torch.randint(0, config.vocab_size, (2, 64))
    phases = step_collectives(model, make_adamw(model, lr=1e-4, fused=True), x, torch.roll(x, -1, 1), groups=groups_of(mesh))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"collectives": phases, "minimum": minimum_collectives(config.n_layer, dp, tp)}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
