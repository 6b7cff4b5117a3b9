"""Measure what the planner estimates, on CPU: the bytes saved for backward by one forward (unique storages of the
tensors autograd saves, parameters left out) and the parameter / gradient / AdamW bytes of one rank after a step.

Run under torchrun with nproc = dp * tp; rank 0 writes <out>.json with the measured and the planned numbers.
"""

import argparse
import json
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from gpt_tp.entry import run
from gpt_tp import planner
from gpt_tp.audit import state_bytes
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.loss import cross_entropy
from gpt_tp.optim import make_adamw
from gpt_tp.parallel import parallelize, reduce_partial_grads


def _local(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


class SavedBytes:
    """saved_tensors_hooks that record every saved tensor's storage once, except the parameters' storages."""

    def __init__(self, model):
        self.params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t):
        s = _local(t).untyped_storage()
        if s.data_ptr() not in self.params:
            self.storages[s.data_ptr()] = max(self.storages.get(s.data_ptr(), 0), s.nbytes())
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=128, vocab_size=2048)
    B, T = 4, 128
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = parallelize(GPT(config), mesh)
    opt = make_adamw(model, lr=1e-3)
    x = torch.randint(0, config.vocab_size, (B, T))
    y = torch.randint(0, config.vocab_size, (B, T))

    saved = SavedBytes(model)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), cast:
        loss = cross_entropy(model(x), y)
    loss.backward()
    reduce_partial_grads(model)
    opt.step()
    states = state_bytes(model, opt)

    planned_act = planner.activation_bytes(config, B, T, args.tp, args.precision)
    planned_states = planner.state_bytes(config, args.dp, args.tp, args.precision)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({
                "measured": {"activations": saved.total, **{k: states[k] for k in ("params", "grads", "optimizer")}},
                "planned": {"activations": sum(planned_act.values()), **planned_states},
                "planned_terms": planned_act,
                "n_saved_storages": len(saved.storages),
            }, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
