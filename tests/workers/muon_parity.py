"""Run under torchrun (gloo, CPU): Muon on the sharded model (gpt_tp.train.optim.Muon.build) against one
device running torch.optim.Muon itself on the block matrices and torch.optim.AdamW on the rest, inside each rank.

Same init, same global batch (each DP rank its slice), clip 1.0 by the global norm, the warmup + cosine multiplier on
both peaks. --fp32: Newton-Schulz in float32 on both sides (torch's own code, its bfloat16 cast made a float32 one).
Writes one JSON line per rank: per-step losses of both, the optimizer step's collectives by group and kind, and
facts about the momentum buffers.

Several runs of one world size, one after another in the same processes (one launch instead of one each): their
argument lists joined by `--then`; each seeds and builds its models afresh."""

import argparse
import contextlib
import copy
import json
from collections import Counter

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from benchmarks.collectives import CollectiveRecorder, groups_of
from benchmarks.synthetic import SyntheticTokens
from gpt_tp.entry import run
from runs import run_all
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.parallel import clip_grad_norm, parallelize, sync_grads
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.train.optim import Muon, get_lr, is_muon_weight
from parity import dp_mean, mesh_of

MAX_LR, MUON_LR = 3e-3, 0.02


@contextlib.contextmanager
def float32_newton_schulz(on: bool):
    """torch.optim.Muon's Newton-Schulz with its `grad.bfloat16()` returning float32: the same code in float32."""
    if not on:
        yield
        return
    cast = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = torch.Tensor.float
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = cast


def main():
    run_all(one_run)  # one run, or several joined by --then


def one_run(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank, dp, tp, mesh, dp_rank = mesh_of(args.dp)

    torch.manual_seed(1234)
    ref = GPT(GPTConfig.from_name("tiny"))
    model = parallelize(copy.deepcopy(ref), mesh)
    opt = Muon(fused=True, lr=MUON_LR, fp32=args.fp32).build(model, MAX_LR)
    matrices = [p for n, p in ref.named_parameters() if is_muon_weight(n)]
    rest = [p for p in ref.parameters() if all(p is not q for q in matrices)]
    ref_opts = [torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=0.1, adjust_lr_fn="original"),
                torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=MAX_LR, betas=(0.9, 0.95), eps=1e-8, fused=True)]
    res = {"rank": rank, "losses": [], "ref_losses": [], "muon_groups": sum(g["muon"] for g in opt.param_groups),
           "muon_params": len(matrices)}
    B, T = 4, 32
    data = SyntheticTokens(B, T, vocab=1024, seed=99)
    for step in range(args.steps):
        x, y = data.batch(step)
        rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
        loss_ref = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss_ref.backward()
        loss = cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        res["losses"].append(dp_mean(loss, mesh))
        res["ref_losses"].append(loss_ref.item())
        sync_grads(model)  # the step's gradient sync (GPTModule.backward's), then the global clip
        clip_grad_norm(model, 1.0)
        clip_grad_norm(ref, 1.0)
        mult = get_lr(step, MAX_LR, 1e-4, 2, args.steps) / MAX_LR
        for o in (opt, *ref_opts):
            for group in o.param_groups:
                group["lr"] = mult * (MUON_LR if group.get("muon", isinstance(o, torch.optim.Muon)) else MAX_LR)
        with CollectiveRecorder(groups_of(mesh)) as rec:
            opt.step()
        with float32_newton_schulz(args.fp32):
            for o in ref_opts:
                o.step()
        for o in (opt, *ref_opts):
            o.zero_grad(set_to_none=True)
        if step == 0:
            res["optimizer_collectives"] = [list(r) for r in rec.records]
    bufs = [(p, opt.state[p]["momentum_buffer"]) for g in opt.param_groups if g["muon"] for p in g["params"]]
    res["buffers_like_params"] = all(isinstance(b, DTensor) and b.placements == p.placements and b.shape == p.shape
                                     for p, b in bufs) if dp * tp > 1 else None
    res["final_param_reldiff"] = max(
        ((p.full_tensor() if isinstance(p, DTensor) else p) - q).norm().item() / q.norm().item()
        for p, q in zip(model.parameters(), ref.parameters()))
    res["kinds"] = dict(Counter(f"{g}:{k}" for g, k, _, _ in res["optimizer_collectives"]))
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    run(main)
