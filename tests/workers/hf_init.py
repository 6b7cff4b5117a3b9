"""Under torchrun: GPTModule(init_from=<HF dir>) parallelized at TP=world gives Hugging Face's loss."""

import argparse
import json

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

from gpt_tp.entry import run
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.train.module import GPTModule
from gpt_tp.parallel import parallelize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("data_parallel", "tensor_parallel"))
    module = GPTModule(model="tiny", init_from=args.hf_dir)
    parallelize(module.model, mesh)
    x = torch.randint(0, 50257, (2, 33), generator=torch.Generator().manual_seed(0))
    x, y = x[:, :-1], x[:, 1:]
    with torch.no_grad():
        ours = cross_entropy(module.model(x), y).item()
        hf = transformers.GPT2LMHeadModel.from_pretrained(args.hf_dir).eval()
        ref = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"ours": ours, "hf": ref, "n_layer": module.config.n_layer}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
