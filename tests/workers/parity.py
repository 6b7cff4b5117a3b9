"""Run under torchrun (gloo, CPU): the tensor-parallel model against a single-device copy, inside each rank.

Every rank builds the reference GPT from the same seed, parallelizes a deep copy on a (dp, tp) mesh and feeds
both the same global batch (each DP rank its slice to the sharded model). It writes one JSON line per rank
with: the step-0 losses, the worst relative gradient difference per parameter, the per-step losses of 6
optimizer steps (clip 1.0, fused AdamW, the LR schedule), tie and placement facts. The test asserts on them.

Several runs of one world size, one after another in the same processes (one launch instead of one each): their
argument lists joined by `--then` (`--out a --then --out b --plan benchmarks.plans:ordered`); each run seeds and
builds its models afresh.
"""

import argparse
import copy
import json
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from gpt_tp.entry import run
from runs import run_all
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.train.optim import AdamW, get_lr
from benchmarks.paritycheck import load_plan
from gpt_tp.parallel import TP_PLAN, clip_grad_norm, parallelize, sync_grads
from benchmarks.collectives import CollectiveRecorder, groups_of
from benchmarks.plans import reduce_dtensor_partial_grads
from benchmarks.synthetic import SyntheticTokens


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def naive_errors(config, mesh):
    """The obvious recipe: parallelize only the Linear/embedding layers, leaving wpe and the LayerNorms as plain
    tensors. Returns the errors its grad-norm and its fused AdamW step raise (None where one does not)."""
    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        "transformer.h.*.attn.c_attn": ColwiseParallel(),
        "transformer.h.*.attn.c_proj": RowwiseParallel(),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    model = GPT(config)
    parallelize_module(model, mesh["tensor_parallel"], plan)
    if mesh["data_parallel"].size() > 1:
        fully_shard(model, mesh=mesh["data_parallel"])
    x, y = SyntheticTokens(2, 16, vocab=1024, seed=5).batch(0)
    with loss_parallel():  # replicated logits: torch's loss
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    errors = []
    for fn in (
        lambda: torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True).full_tensor(),
        lambda: AdamW(fused=True).build(model, 1e-3).step(),
    ):
        try:
            fn()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - we want the message whatever the type
            errors.append(f"{type(e).__name__}: {e}"[:500])
    return errors


_MESHES = {}  # dp -> the mesh: the runs of one launch at one layout share it, as a process of its own has one


def mesh_of(dp: int):
    """The gloo process group and the (dp, tp) mesh over it: (rank, dp, tp, mesh, this rank's DP index)."""
    if not dist.is_initialized():  # one group for all the runs of a launch
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp not in _MESHES:
        _MESHES[dp] = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    mesh = _MESHES[dp]
    return rank, dp, world // dp, mesh, mesh["data_parallel"].get_local_rank()


def dp_mean(loss: torch.Tensor, mesh) -> float:
    """This DP rank's loss -> the mean over the DP ranks."""
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=mesh["data_parallel"].get_group())
    return loss.item() / mesh["data_parallel"].size()


def main():
    run_all(one_run)  # one run, or several joined by --then


def one_run(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--plan", help="module:attribute of another plan (default gpt_tp's TP_PLAN)")
    ap.add_argument("--skip-naive", action="store_true", help="leave out the naive recipe's errors")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank, dp, tp, mesh, dp_rank = mesh_of(args.dp)

    torch.manual_seed(1234)
    config = GPTConfig.from_name("tiny")
    ref = GPT(config)
    plan = TP_PLAN if args.plan is None else load_plan(args.plan, config)
    model = parallelize(copy.deepcopy(ref), mesh, plan=plan)
    params = [id(p) for p in model.parameters()]
    assert parallelize(model, mesh) is model and [id(p) for p in model.parameters()] == params  # idempotent
    res = {
        "rank": rank,
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "meshes": sorted({str(p.device_mesh.mesh.tolist()) for p in model.parameters()}),
        "init_diff": max(rel(full(p), q) for p, q in zip(model.parameters(), ref.parameters())),
    }

    opt_ref, opt = (AdamW(fused=True).build(m, 3e-3) for m in (ref, model))
    init = [q.detach().clone() for q in ref.parameters()]
    B, T = 4, 32  # B rows in the global batch, split over dp
    data = SyntheticTokens(B, T, vocab=1024, seed=99)  # learnable sequences: the loss falls within a few steps
    res["losses"], res["ref_losses"], res["norms"], res["ref_norms"] = [], [], [], []
    for step in range(args.steps):
        x, y = data.batch(step)
        rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
        loss_ref = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())  # torch's loss on the unsharded model
        with CollectiveRecorder(groups_of(mesh)) as fwd:
            loss = cross_entropy(model(x[rows]), y[rows])  # gpt_tp's vocab-parallel loss
        loss_ref.backward()
        with CollectiveRecorder(groups_of(mesh)) as bwd:
            loss.backward()
        if step == 0:  # the TP group's collectives by kind, forward and backward
            for phase, rec in (("forward", fwd), ("backward", bwd)):
                res[f"tp_collectives_{phase}"] = dict(Counter(k for g, k, _, _ in rec.records if g == "tensor_parallel"))
        res["losses"].append(dp_mean(loss, mesh))
        res["ref_losses"].append(loss_ref.item())
        reduce_dtensor_partial_grads(model)  # torch_recipe's Partial LayerNorm gradients (none in other plans)
        sync_grads(model)  # the step's gradient sync, then the clip
        res["norms"].append(clip_grad_norm(model, 1.0).item())
        res["ref_norms"].append(clip_grad_norm(ref, 1.0).item())
        if step == 0:  # both clipped by (almost) the same factor: the relative differences are the gradients'
            res["grad_diff"] = {n: rel(full(p.grad), q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())}
        for o in (opt, opt_ref):
            for group in o.param_groups:
                group["lr"] = get_lr(step, max_lr=3e-3, min_lr=1e-4, warmup_steps=2, max_steps=args.steps)
            o.step()
            o.zero_grad(set_to_none=True)
    # per parameter: how far the TP run ended from the single-device run, relative to how far training moved it
    res["final_param_reldiff"] = max(
        ((full(p) - q).norm() / (q - q0).norm()).item() for p, q, q0 in zip(model.parameters(), ref.parameters(), init)
    )
    res["naive_errors"] = [] if args.skip_naive else naive_errors(config, mesh)
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    run(main)  # ends the process group before exit (gpt_tp.entry)
