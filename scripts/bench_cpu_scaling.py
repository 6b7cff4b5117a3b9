"""CPU scaling figure: TP=2 (2 processes x 1 thread) step time over TP=1 (1 process x 1 thread), side by side.

    python scripts/bench_cpu_scaling.py --batch-size 2 --seq-len 1024 --pairs 6 --compile --json cpu_scaling.json

GPT-2 124M shapes, the same micro-batch for both. One torchrun job of 3 gloo processes: rank 0 trains the
single-device model, ranks 1-2 the TP=2 model (gpt_tp's plan), and they take turns step by step (the order
alternates every pair), so both see the same machine load. The step is gpt_tp.perf.bench.train_step (forward,
vocab-parallel loss, backward, replicated-grad all-reduce, clip, fused AdamW). Reported: the ratio of the
median step times, the per-pair ratios min/median/max, each side's min/median/max, and a profile of one step
of each by category (matmuls, attention, collectives, optimizer, rest) to show what limits the ratio.
Goal: ratio <= 0.6 (0.5 is perfect splitting with free communication).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

CATEGORIES = [  # (category, substrings of profiler op names), first match wins
    ("collectives", ("c10d", "gloo", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "wait_tensor", "barrier")),
    ("optimizer", ("adam", "_foreach", "clip")),
    ("attention", ("scaled_dot_product", "flash", "_efficient_attention")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")),
    ("loss + embeddings", ("crossentropy", "cross_entropy", "log_softmax", "nll_loss", "aten::exp", "aten::amax", "embedding")),
]


def categorize(prof) -> dict:
    """Self CPU seconds of one profiled step by category, and the largest uncategorised ops."""
    out = {c: 0.0 for c, _ in CATEGORIES} | {"rest": 0.0}
    rest = []
    for evt in prof.key_averages():
        name = evt.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k.lower() in name for k in keys)), "rest")
        out[cat] += evt.self_cpu_time_total / 1e6
        if cat == "rest":
            rest.append((evt.self_cpu_time_total / 1e6, evt.key, evt.count))
    out["top_rest"] = [f"{k} x{n}: {t:.3f}s" for t, k, n in sorted(rest, reverse=True)[:8]]
    return out


def worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from gpt_tp.perf.bench import build, stats, train_step
    from gpt_tp.model import GPTConfig
    from gpt_tp.perf.synthetic import SyntheticTokens

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    names = ("data_parallel", "tensor_parallel")
    meshes = {1: DeviceMesh("cpu", torch.tensor([[0]]), mesh_dim_names=names),
              2: DeviceMesh("cpu", torch.tensor([[1, 2]]), mesh_dim_names=names)}  # created on every rank
    job = 1 if rank == 0 else 2
    config = GPTConfig.from_name("gpt2")
    torch.manual_seed(0)
    model, opt = build(config, meshes[job], torch.device("cpu"), compile=args.compile)
    x, y = SyntheticTokens(args.batch_size, args.seq_len, vocab=50257, seed=0).batch(0)

    def turn(tp: int, fn):
        """All 3 ranks: the job `tp` runs fn while the other waits at the barrier."""
        dist.barrier()
        out = fn() if job == tp else None
        dist.barrier()
        return out

    def timed():
        t0 = time.perf_counter()
        train_step(model, opt, x, y, "32-true")
        return time.perf_counter() - t0

    times = {1: [], 2: []}
    for i in range(args.warmup + args.pairs):
        for tp in ((1, 2) if i % 2 == 0 else (2, 1)):
            t = turn(tp, timed)
            if i >= args.warmup and t is not None:
                times[tp].append(t)

    def profiled():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t = timed()
        return {"step_s": t, **categorize(prof)}

    profile = {tp: turn(tp, profiled) for tp in (1, 2)}

    def comm_only():
        """The step's TP activation collectives alone (4L + 2 all-gathers + 4L + 2 reduce-scatters of a
        (B, T, C) float32 tensor): the transfer cost, without waiting for a slower rank's compute."""
        group = meshes[2]["tensor_parallel"].get_group()
        shard = torch.randn(args.batch_size, args.seq_len // 2, config.n_embd)
        full = torch.empty(args.batch_size * 2, args.seq_len // 2, config.n_embd)
        n = 4 * config.n_layer + 2
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_gather_single(full, shard, group=group)
            dist.reduce_scatter_single(shard, full, group=group)
        return time.perf_counter() - t0

    comm = turn(2, comm_only)
    mine = {"rank": rank, "times": times[job], "profile": profile[job], "comm_only_s": comm}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        t1 = gathered[0]["times"]
        t2 = [max(a, b) for a, b in zip(gathered[1]["times"], gathered[2]["times"])]  # the slower TP rank
        ratios = [b / a for a, b in zip(t1, t2)]
        res = {
            "model": "gpt2 (124M)", "compile": args.compile, "batch_size": args.batch_size, "seq_len": args.seq_len, "pairs": args.pairs,
            "tp1_step_s": stats(t1), "tp2_step_s": stats(t2),
            "ratio_of_medians": statistics.median(t2) / statistics.median(t1),
            "pair_ratios": stats(ratios), "tp1_times": t1, "tp2_times": t2,
            "profile_tp1": gathered[0]["profile"], "profile_tp2_rank0": gathered[1]["profile"],
            "profile_tp2_rank1": gathered[2]["profile"],
            "tp2_comm_only_s": max(gathered[1]["comm_only_s"], gathered[2]["comm_only_s"]),
        }
        Path(args.json).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


def summary(res: dict) -> str:
    f = lambda s: f"{s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f}"  # noqa: E731
    lines = [
        f"GPT-2 124M, micro-batch {res['batch_size']} x {res['seq_len']}, {res['pairs']} interleaved pairs, fp32, "
        f"{'compiled blocks' if res.get('compile') else 'eager'}, 1 thread per process",
        f"TP=1 step s  min / median / max: {f(res['tp1_step_s'])}",
        f"TP=2 step s  min / median / max: {f(res['tp2_step_s'])}",
        f"ratio TP=2 / TP=1 (medians): {res['ratio_of_medians']:.3f}   per pair min / median / max: "
        f"{res['pair_ratios']['min']:.3f} / {res['pair_ratios']['median']:.3f} / {res['pair_ratios']['max']:.3f}   (goal <= 0.6)",
        "one profiled step, self CPU seconds by category:",
    ]
    p1, p2 = res["profile_tp1"], res["profile_tp2_rank0"]
    for k in p1:
        if k not in ("step_s", "top_rest"):
            lines.append(f"  {k:<18} TP=1 {p1[k]:7.3f}   TP=2 rank 0 {p2[k]:7.3f}" + (f"   ratio {p2[k] / p1[k]:.2f}" if p1[k] > 1e-3 else ""))
    lines.append(f"  {'step (wall)':<18} TP=1 {p1['step_s']:7.3f}   TP=2 rank 0 {p2['step_s']:7.3f}")
    lines.append(f"  the TP collectives alone (same count and sizes, no compute): {res['tp2_comm_only_s']:.3f} s per step")
    lines.append("  largest uncategorised ops, TP=2 rank 0: " + "; ".join(p2["top_rest"]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256, help="must be even (sequence parallelism splits it)")
    ap.add_argument("--pairs", type=int, default=8, help="timed TP=1 / TP=2 step pairs")
    ap.add_argument("--warmup", type=int, default=1, help="untimed pairs first")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (both sides; warm-up compiles)")
    ap.add_argument("--json", default="cpu_scaling.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.seq_len % 2 or not 0 < args.seq_len <= 1024 or args.batch_size < 1 or args.pairs < 1 or args.warmup < 0:
        print(f"error: --seq-len={args.seq_len} must be even and in 2..1024, --batch-size and --pairs >= 1, --warmup >= 0",
              file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", __file__, "--worker",
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--pairs", str(args.pairs),
           "--warmup", str(args.warmup), *(["--compile"] if args.compile else []), "--json", str(Path(args.json).resolve())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return proc.returncode
    print(summary(json.loads(Path(args.json).read_text())))
    return 0


if __name__ == "__main__":
    from gpt_tp.entry import run

    run(main)  # ends the process group before exit
