"""Muon's optimizer step by each of its schemes (gpt_tp.train.muon), owner-computes and sharded: bytes and time.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks.muon_comm --model gpt2 --layers 2

On a DP x TP mesh (TP the rest of the processes), the model's block matrices get random gradients; then Muon's step on
them alone, every matrix by one scheme, alternates between the two schemes, --steps times each, on the same
parameters: "owner" (each matrix's shards sent to one owner rank, Newton-Schulz once there, the update's blocks sent
back) and "sharded" (Newton-Schulz on the long-side shards, Grams all-reduced). Rank 0 prints, per scheme, the median
step time (the slowest rank's) and the collectives this rank recorded in one step with their bytes, beside
benchmarks.collectives.muon_collectives, and the bytes of all-gathering every matrix once (muon_gather_all_bytes).
"""

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.collectives import (CollectiveRecorder, collective, groups_of, merge, muon_collectives,
                                    muon_gather_all_bytes)
from benchmarks.step import build, slowest
from gpt_tp.entry import ArgumentParser, run, torchrun_mesh
from gpt_tp.errors import UserError
from gpt_tp.model import SIZES, GPTConfig
from gpt_tp.train.muon import ShardedMuon
from gpt_tp.train.optim import is_muon_weight


def step_time(opt, device: torch.device) -> float:
    t0 = time.perf_counter()
    opt.step()
    return slowest([time.perf_counter() - t0], device).item()


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m benchmarks.muon_comm", description=__doc__)
    ap.add_argument("--model", default="gpt2", choices=list(SIZES), help="a named size (default gpt2)")
    ap.add_argument("--layers", type=int, default=2, help="blocks (default 2: the figures are per step of these)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size; TP is the rest of the processes")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per scheme (default 3)")
    args = ap.parse_args(argv)
    if min(args.layers, args.dp, args.steps) < 1:
        raise UserError("--layers, --dp and --steps must be >= 1")
    config = GPTConfig.from_name(args.model, n_layer=args.layers)
    world = int(os.environ.get("WORLD_SIZE", 1))
    dp, tp = args.dp, max(1, world // args.dp)
    mesh, device = torchrun_mesh(dp, tp, "cpu")
    torch.manual_seed(0)
    model = build(config, mesh, device, optimizer="muon").model  # gpt_tp's training step's model
    matrices = [p for n, p in model.named_parameters() if is_muon_weight(n)]
    schemes = {s: ShardedMuon([{"params": matrices, "muon": True}], scheme=s, lr=0.02, weight_decay=0.1)
               for s in ("owner", "sharded")}
    for p in model.parameters():
        local = torch.randn((p.to_local() if isinstance(p, DTensor) else p).shape)
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()) \
            if isinstance(p, DTensor) else local
    out = {}
    for name, opt in schemes.items():
        with CollectiveRecorder(groups_of(mesh)) as rec:
            opt.step()  # also makes the momentum buffers
        rows = merge([collective(*r[:3], 1, r[3]) for r in rec.records])
        out[name] = {"rows": rows, "times": []}
    for _ in range(args.steps):
        for name, opt in schemes.items():
            out[name]["times"].append(step_time(opt, device))
    if dist.get_rank() == 0:
        print(f"{args.model} shapes, {args.layers} blocks, DP={dp} x TP={tp}: Muon's optimizer step")
        modeled = {s: sum(r["wire_bytes"] for r in muon_collectives(config, dp, tp, scheme=s)) for s in schemes}
        print(f"  all-gathering every matrix once: {muon_gather_all_bytes(config, dp, tp) / 2**20:.2f} MiB per rank")
        for name, r in out.items():
            wire = sum(row["wire_bytes"] for row in r["rows"])
            kinds = ", ".join(f"{row['dim']} {row['kind']} {row['count']}x" for row in r["rows"])
            print(f"  {name:<11} step {statistics.median(r['times']):.3f} s (median of {args.steps}), wire bytes on "
                  f"rank 0 {wire / 2**20:.2f} MiB (model {modeled[name] / 2**20:.2f} MiB): {kinds}")
    return 0


if __name__ == "__main__":
    run(main)
