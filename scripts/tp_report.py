"""Memory and communication of one tensor-parallel training step, next to the single-device model.

    python -m torch.distributed.run --standalone --nproc_per_node=2 scripts/tp_report.py --model gpt2

Prints (rank 0) the per-rank bytes of parameters + gradients + AdamW state at TP=world vs TP=1, and the
collectives of one full training step by phase and kind, against the Megatron sequence-parallel minimum
(gpt_tp/perf/audit.py derives it). --json writes the same figures to a file.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gpt_tp.perf.audit import megatron_sp_minimum, state_bytes, step_collectives
from gpt_tp.entry import run
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.train.optim import make_adamw
from gpt_tp.parallel import parallelize


def one_step_bytes(model, x, y):
    opt = make_adamw(model, lr=1e-4)
    phases = step_collectives(model, opt, x, y)
    return phases, state_bytes(model, opt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="a named size (gpt2, gpt2-medium, ..., tiny)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256, help="collective counts do not depend on it")
    ap.add_argument("--layers", type=int, help="override the number of blocks")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    config = GPTConfig.from_name(args.model, **({"n_layer": args.layers} if args.layers else {}))
    torch.manual_seed(0)
    x = torch.randint(0, 50257, (args.batch_size, args.seq_len))
    y = torch.roll(x, -1, dims=1)

    _, single = one_step_bytes(GPT(config), x, y)  # TP=1 in this process, for the ratio
    phases, sharded = one_step_bytes(parallelize(GPT(config), mesh), x, y)
    report = {
        "model": args.model,
        "tp": tp,
        "bytes_tp1": single,
        f"bytes_tp{tp}_per_rank": sharded,
        "ratio": sharded["total"] / single["total"],
        "collectives": phases,
        "megatron_minimum": megatron_sp_minimum(config.n_layer),
    }
    if dist.get_rank() == 0:
        gib = 2**30
        print(f"{args.model}: params+grads+AdamW per rank  TP=1 {single['total'] / gib:.3f} GiB   "
              f"TP={tp} {sharded['total'] / gib:.3f} GiB   ratio {report['ratio']:.4f}")
        for phase, kinds in phases.items():
            print(f"  {phase:<20} " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
        print(f"  {'megatron minimum':<20} " + ", ".join(f"{k} {v}" for k, v in sorted(report["megatron_minimum"].items())))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
