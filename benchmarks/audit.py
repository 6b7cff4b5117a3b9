"""Audit one training step on a data-parallel x tensor-parallel mesh: what it communicates and stores, measured,
against the model the planner, the cost model and the benchmark use (gpt_tp.sizing.sizes, benchmarks.collectives).

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks.audit --model gpt2
    python -m torch.distributed.run --standalone --nproc_per_node=4 -m benchmarks.audit --model tiny --dp 2

One float32 training step, the benchmark's (benchmarks.step.train_step: forward, vocab-parallel loss, backward,
gradient sync and clipping, fused AdamW), runs with every collective recorded, by phase and by process group,
with its bytes. The audit holds:
  - the collectives, count and bytes per (group, kind), equal benchmarks.collectives.step_collectives: on the TP
    group Megatron's sequence parallelism, all_gather 6L + 3, reduce_scatter 4L + 2, all_reduce 3 (with the
    derivation in benchmarks.collectives.tp_collectives); on the DP group FSDP2's all_gather 2L + 1 and
    reduce_scatter L + 1 and no all-reduce; one grad-norm all-reduce over the whole mesh;
  - no collective inside AdamW's step; with --optimizer muon, Muon's (benchmarks.collectives.muon_collectives);
  - parameters, gradients and optimizer state held by this rank equal gpt_tp.sizing.sizes.state_bytes.
Rank 0 prints the figures (and writes them with --json); the command exits 1, naming what differs, when one does
not hold.
"""

import json
import os
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.collectives import CollectiveRecorder, collective, counts, groups_of, merge, step_collectives
from benchmarks.step import build, train_step
from gpt_tp.entry import ArgumentParser, run, torchrun_mesh
from gpt_tp.errors import UserError
from gpt_tp.model import SIZES, GPTConfig
from gpt_tp.sizing import sizes


def measure_collectives(step, x: torch.Tensor, y: torch.Tensor,
                        groups: dict[str, tuple[str, int]]) -> tuple[dict[str, dict], list[dict]]:
    """Run one float32 training step (benchmarks.step.train_step) and return the collectives it issued: ({phase, 'total'
    or 'by_group': {kind or group: count}}, and the rows of benchmarks.collectives.step_collectives with their bytes).
    `groups`: benchmarks.collectives.groups_of(mesh). The gradients stay in place."""
    recorders: dict[str, CollectiveRecorder] = {}

    @contextmanager
    def phase(name):
        recorders[name] = CollectiveRecorder(groups)
        with recorders[name]:
            yield

    train_step(step, x, y, phase=phase)
    records = [r for rec in recorders.values() for r in rec.records]
    phases = {name: Counter(kind for _, kind, _, _ in rec.records) for name, rec in recorders.items()}
    phases["total"] = sum(phases.values(), Counter())
    rows = merge([collective(label, kind, size, 1, nbytes) for label, kind, size, nbytes in records])
    out = {k: dict(v) for k, v in phases.items()}
    out["by_group"] = dict(sorted(counts(rows).items()))
    return out, rows


def measure_state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only), and their total."""

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list({id(p): p for p in model.parameters()}.values())
    out = {
        "params": sum(local(p) for p in params),
        "grads": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
    }
    return {**out, "total": sum(out.values())}


def differences(report: dict) -> list[str]:
    """What the measurement shows that the model does not: one line each."""
    key = lambda rows: sorted((r["dim"], r["kind"], r["group_size"], r["count"], r["bytes"]) for r in rows)  # noqa: E731
    out = []
    if key(report["measured"]["collective_rows"]) != key(report["modeled"]["collective_rows"]):
        out.append(f"collectives {report['measured']['collectives']['by_group']} (bytes "
                   f"{key(report['measured']['collective_rows'])}) differ from the model's "
                   f"{report['modeled']['by_group']} (bytes {key(report['modeled']['collective_rows'])})")
    if report["optimizer"] == "adamw" and report["measured"]["collectives"]["optimizer"]:
        out.append(f"the optimizer step communicates: {report['measured']['collectives']['optimizer']}")
    if report["measured"]["state_bytes"] != report["modeled"]["state_bytes"]:
        out.append(f"state bytes per rank {report['measured']['state_bytes']} differ from the model's "
                   f"{report['modeled']['state_bytes']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m benchmarks.audit", description=__doc__)
    ap.add_argument("--model", default="gpt2", choices=list(SIZES), help="a named size (default gpt2)")
    ap.add_argument("--layers", type=int, help="override the number of blocks")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size; TP is the rest of the processes (default 1)")
    ap.add_argument("--batch-size", type=int, default=1, help="rows per data-parallel rank (default 1)")
    ap.add_argument("--seq-len", type=int, help="tokens per row (default 256, or the model's block_size if smaller; the "
                    "counts do not depend on it)")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"), help="adamw (default) or muon: model.optimizer AdamW or Muon")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if min(args.dp, args.batch_size, args.seq_len or 1, args.layers or 1) < 1:
        raise UserError("--dp, --batch-size, --seq-len and --layers must be >= 1")
    config = GPTConfig.from_name(args.model, **({"n_layer": args.layers} if args.layers else {}))
    if args.seq_len is None:
        args.seq_len = min(256, config.block_size)
    if args.seq_len > config.block_size:
        raise UserError(f"--seq-len={args.seq_len} exceeds the model's block_size={config.block_size}; lower --seq-len")
    world = int(os.environ.get("WORLD_SIZE", 1))
    dp, tp = args.dp, max(1, world // args.dp)
    mesh, device = torchrun_mesh(dp, tp, "cpu")
    torch.manual_seed(0)
    step = build(config, mesh, device, optimizer=args.optimizer)
    x = torch.randint(0, min(config.vocab_size, 50257), (args.batch_size, args.seq_len))
    collectives, rows = measure_collectives(step, x, torch.roll(x, -1, 1), groups_of(mesh))
    modeled_rows = step_collectives(config, args.batch_size, args.seq_len, dp, tp, optimizer=args.optimizer,
                                   rank=dist.get_rank())
    report = {
        "model": args.model, "n_layer": config.n_layer, "dp": dp, "tp": tp, "optimizer": args.optimizer,
        "measured": {"collectives": collectives, "collective_rows": rows,
                     "state_bytes": measure_state_bytes(step.model, step.optimizer)},
        "modeled": {"by_group": counts(modeled_rows), "collective_rows": modeled_rows,
                    "state_bytes": sizes.state_bytes(config, dp, tp, optimizer=args.optimizer),
                    "state_bytes_tp1": sizes.state_bytes(config, 1, 1, optimizer=args.optimizer)},
    }
    report["differences"] = differences(report)
    if dist.get_rank() == 0:
        print(format_report(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 1 if report["differences"] else 0


def format_report(r: dict) -> str:
    gib, m = 2**30, r["measured"]
    one, here = r["modeled"]["state_bytes_tp1"]["total"], m["state_bytes"]["total"]
    lines = [f"{r['model']} ({r['n_layer']} blocks), DP={r['dp']} x TP={r['tp']}: params+grads+{r['optimizer']} "
             f"per rank "
             f"{here / gib:.3f} GiB, {here / one:.4f} of one device's {one / gib:.3f} GiB"]
    for phase in ("forward", "backward", "grad_sync_and_clip", "optimizer"):
        lines.append(f"  {phase:<20} " + (", ".join(f"{k} {v}" for k, v in sorted(m["collectives"][phase].items())) or "-"))
    for group, kinds in m["collectives"]["by_group"].items():
        modeled = r["modeled"]["by_group"].get(group, {})
        lines.append(f"  {group:<20} " + ", ".join(f"{k} {v} (model {modeled.get(k, 0)})" for k, v in sorted(kinds.items())))
    lines += [f"DIFFERS: {d}" for d in r["differences"]] or ["audit: the step communicates and stores what the model says"]
    return "\n".join(lines)


if __name__ == "__main__":
    run(main)
