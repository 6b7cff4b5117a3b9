"""Parity check: is the tensor-parallel model the same model as the single-device one?

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks.paritycheck --config configs/cpu.yaml
    torchrun --nproc_per_node=4 -m benchmarks.paritycheck --model gpt2 --dp 2 --tp 2 --batch-size 2 --seq-len 256

One batch goes through the sharded model (gpt_tp's plan, or --plan module:attribute) and an unsharded copy built
from the same seed, in float32; it prints both losses and the worst weight and gradient differences per parameter.
Exit code 0 within --tol, 1 beyond it (or if the sharded model fails to run), 2 on bad input (docs/performance.md).
"""

import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from benchmarks.plans import import_attribute
from gpt_tp.entry import ArgumentParser, run, torchrun_mesh, torchrun_world
from gpt_tp.errors import UserError
from gpt_tp.model import GPT, HF_VOCAB_SIZE, SIZES, GPTConfig
from gpt_tp.parallel import TP_PLAN, parallelize, sync_grads
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.sizing import LayoutError, validate_layout


class ParityInputError(UserError):
    """A bad flag or config; the message says what to change."""


def load_plan(spec: str, config: GPTConfig) -> dict:
    """--plan module:attribute -> {module path: ParallelStyle}; a callable attribute is called with the config."""
    try:
        plan = import_attribute(spec, "--plan", "gpt_tp.parallel:TP_PLAN")
    except UserError as e:
        raise ParityInputError(str(e)) from None
    if callable(plan) and not isinstance(plan, dict):
        plan = plan(config)
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, ParallelStyle) for k, v in plan.items()):
        raise ParityInputError(f"--plan={spec!r} is not a dict of module path -> ParallelStyle (like gpt_tp.parallel.TP_PLAN)")
    return plan


def rel_diff(a: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """max |a - ref| / max |ref|, `a` gathered if sharded; inf if the shapes differ or one is None, 0 if both are."""
    if a is None or ref is None:
        return 0.0 if a is None and ref is None else float("inf")
    a = a.full_tensor() if isinstance(a, DTensor) else a
    if a.shape != ref.shape:
        return float("inf")
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def compare(config: GPTConfig, mesh, batch_size: int, seq_len: int, seed: int, plan: dict | None, device) -> dict:
    """Run one batch through the sharded model and an unsharded copy; return losses and per-parameter diffs."""
    dp, dp_rank = mesh["data_parallel"].size(), mesh["data_parallel"].get_local_rank()
    torch.manual_seed(seed)
    with torch.device(device):
        ref = GPT(config)
    model = parallelize(copy.deepcopy(ref), mesh, plan=TP_PLAN if plan is None else plan)
    ref_params = dict(ref.named_parameters())  # the tied lm_head appears once, as wte
    weights = {n: rel_diff(p.detach(), ref_params[n].detach()) for n, p in model.named_parameters() if n in ref_params}

    g = torch.Generator().manual_seed(seed)  # the same tokens on every rank: random ids of GPT-2's vocabulary
    tokens = torch.randint(0, min(config.vocab_size, HF_VOCAB_SIZE), (batch_size * dp, seq_len + 1), generator=g)
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (dp B, T) each
    rows = slice(dp_rank * batch_size, (dp_rank + 1) * batch_size)
    loss_ref = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())  # torch's own loss on the unsharded copy
    loss_ref.backward()
    loss = cross_entropy(model(x[rows]), y[rows])  # gpt_tp's vocab-parallel loss on the sharded model
    loss.backward()
    sync_grads(model)
    loss = loss.detach().clone()
    if dp > 1:
        dist.all_reduce(loss, group=mesh["data_parallel"].get_group())
        loss = loss / dp
    grads = {n: rel_diff(p.grad, ref_params[n].grad) for n, p in model.named_parameters() if n in ref_params}
    return {"loss": loss.item(), "ref_loss": loss_ref.item(), "weights": weights, "grads": grads}


def report(res: dict, tol: float, top: int) -> tuple[str, bool]:
    loss_rel = abs(res["loss"] - res["ref_loss"]) / max(abs(res["ref_loss"]), 1e-12)
    lines = [f"loss  sharded {res['loss']:.6f}  unsharded {res['ref_loss']:.6f}  "
             f"difference {res['loss'] - res['ref_loss']:+.3e} (relative {loss_rel:.2e})"]
    if bad_w := {n: v for n, v in res["weights"].items() if not v <= tol}:
        lines.append("weights differ after sharding (the plan changes the model):")
        lines += [f"  {n:<45} {v:.2e}" for n, v in sorted(bad_w.items(), key=lambda kv: -kv[1])[:top]]
    worst = sorted(res["grads"].items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else float("-inf"))
    lines.append(f"worst gradient difference per parameter (max |g - g_ref| / max |g_ref|), {min(top, len(worst))} "
                 f"of {len(worst)}:")
    lines += [f"  {n:<45} {v:.2e}{'  <-- beyond tolerance' if not v <= tol else ''}" for n, v in worst[:top]]
    ok = loss_rel <= tol and not bad_w and all(v <= tol for v in res["grads"].values())
    lines.append(f"{'PASS' if ok else 'FAIL'}: tolerance {tol:g}" + ("" if ok else
                 " -- the tensor-parallel model is not the single-device model; check the plan for the parameters above"))
    return "\n".join(lines), ok


def settings(args, world: int) -> dict:
    """Flags over the --config files over defaults; validated against the world size. --dp or --tp on the command
    line replaces the config's layout as a whole: a size not given is then derived (dp 1, tp = processes / dp)."""
    s = {"config": None, "dp": 1, "tp": None, "batch_size": 2, "seq_len": 64}
    if args.config:  # as `python cli.py fit --config FILE ...` reads them; an "auto" layout size is derived below
        from gpt_tp.cli.config import read_training_config
        try:
            c = read_training_config([a for f in args.config for a in ("--config", f)])
        except UserError as e:
            files = " ".join(args.config)
            raise ParityInputError(str(e) if str(e).startswith("--config") else f"--config {files}: {e}") from None
        dp, tp = (None if v == "auto" else v for v in (c.dp, c.tp))
        s.update(config=c.model, dp=dp, tp=tp, batch_size=c.fit.data.batch_size, seq_len=c.fit.data.seq_len)
    if args.dp is not None or args.tp is not None:
        s["dp"], s["tp"] = (1 if args.dp is None else args.dp), args.tp
    s.update({k: getattr(args, k) for k in ("batch_size", "seq_len") if getattr(args, k) is not None})
    for k in ("dp", "tp"):
        if s[k] is not None and s[k] < 1:
            raise ParityInputError(f"--{k}={s[k]} must be a positive integer")
    if args.layers is not None and args.layers < 1:
        raise ParityInputError(f"--layers={args.layers} must be >= 1: with no block there is nothing to check")
    if args.model is not None or s["config"] is None:
        name = args.model or "tiny"
        if name not in SIZES:
            raise ParityInputError(f"--model={name!r} is unknown; choose one of {', '.join(SIZES)}")
        s["config"] = GPTConfig.from_name(name)
    config = s["config"] if args.layers is None else replace(s["config"], n_layer=args.layers)
    if s["tp"] is None and s["dp"] is None:
        s["dp"] = 1
    for known, other in (("dp", "tp"), ("tp", "dp")):
        if s[other] is None:
            if world % s[known]:
                raise ParityInputError(f"--{known} {s[known]} does not divide the {world} processes torchrun started; "
                                       f"set --nproc_per_node to a multiple of {s[known]} or change --{known}")
            s[other] = world // s[known]
    if s["dp"] * s["tp"] != world:
        raise ParityInputError(f"--dp {s['dp']} x --tp {s['tp']} = {s['dp'] * s['tp']} but torchrun started {world} "
                               f"processes; set --nproc_per_node={s['dp'] * s['tp']} or change --dp/--tp")
    if s["batch_size"] < 1 or s["seq_len"] < 1 or s["seq_len"] > config.block_size:
        raise ParityInputError(f"--batch-size={s['batch_size']} must be >= 1 and --seq-len={s['seq_len']} in "
                               f"1..block_size={config.block_size}")
    try:
        validate_layout(config, tp=s["tp"], dp=s["dp"], seq_len=s["seq_len"])
    except LayoutError as e:
        raise ParityInputError(f"{e} (--tp, --dp, --seq-len)") from None
    return {**s, "config": config}


def parser() -> ArgumentParser:
    ap = ArgumentParser("torchrun --nproc_per_node=N -m benchmarks.paritycheck", __doc__)
    ap.add_argument("--config", action="append", help="a training YAML (python cli.py fit --config ...): model, layout, "
                    "batch shape, read as the trainer reads it; repeat it to stack files as cli.py does")
    ap.add_argument("--model", help=f"a named size: {', '.join(SIZES)} (default tiny); replaces the --config's model")
    ap.add_argument("--layers", type=int, help="override the number of blocks, >= 1 (a quicker check of a big model)")
    ap.add_argument("--tp", type=int, help="tensor-parallel size (default: the --config's, else processes / dp); "
                    "--tp or --dp replaces the --config's layout")
    ap.add_argument("--dp", type=int, help="data-parallel size (default: the --config's, else 1)")
    ap.add_argument("--batch-size", type=int, help="rows per data-parallel rank (default: the --config's, else 2)")
    ap.add_argument("--seq-len", type=int, help="tokens per row (default: the --config's, else 64)")
    ap.add_argument("--plan", help="module:attribute of a custom TP plan (dict, or function of the GPTConfig)")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative tolerance for loss, weights and gradients (1e-4)")
    ap.add_argument("--top", type=int, default=10, help="parameters to list, worst first (default 10)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--json", help="also write the figures here (rank 0)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    s = settings(args, torchrun_world())
    plan = load_plan(args.plan, s["config"]) if args.plan else None
    if not args.tol > 0:
        raise ParityInputError(f"--tol={args.tol} must be > 0")
    mesh, device = torchrun_mesh(s["dp"], s["tp"], args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # compare in true float32 (the flags only act on CUDA)
    torch.backends.cudnn.allow_tf32 = False
    rank = mesh.get_rank()
    try:
        res = compare(s["config"], mesh, s["batch_size"], s["seq_len"], args.seed, plan, device)
    except Exception as e:  # noqa: BLE001 - a broken plan fails in many ways; say so and exit 1
        print(f"FAIL (rank {rank}): the tensor-parallel model did not run: {type(e).__name__}: {e}"[:2000], file=sys.stderr)
        return 1  # gpt_tp.entry.run leaves without waiting on peers that may be stuck in a collective
    text, ok = report(res, args.tol, args.top)
    if rank == 0:
        c = s["config"]
        print(f"parity check: n_layer={c.n_layer} n_head={c.n_head} n_embd={c.n_embd} vocab={c.vocab_size}, "
              f"DP={s['dp']} x TP={s['tp']}, batch {s['batch_size']}x{s['seq_len']} per DP rank, "
              f"plan {args.plan or 'gpt_tp.parallel.TP_PLAN'}")
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps({**res, "ok": ok, "dp": s["dp"], "tp": s["tp"]}, indent=1))
    return 0 if ok else 1  # gpt_tp.entry.run ends the process group


if __name__ == "__main__":
    run(main)
