"""One benchmark run, one process of it: started by benchmarks.bench under torchrun with a spec file.

    python -m torch.distributed.run --standalone --nproc_per_node=<dp x tp> -m benchmarks.bench_worker <spec.json>

The model is parallelized with the spec's `plan` (module:attribute, benchmarks.paritycheck.load_plan), then
`warmup` untimed steps, then `steps` timed ones on generated tokens; the step time is the slowest rank's. One
more step runs under a CollectiveRecorder. Rank 0 writes the result to the spec's `result` file; a rank that fails
writes its error next to it (<result>.rank<N>.error) for the launcher, then raises.
"""

import json
import os
from contextlib import contextmanager
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gpt_tp.train.muon as muon

from benchmarks.collectives import CollectiveRecorder, groups_of
from benchmarks.step import build, peak_memory, slowest, stats, sync, train_step
from benchmarks.synthetic import SyntheticTokens
from gpt_tp.entry import ArgumentParser, run, torchrun_mesh
from benchmarks.paritycheck import load_plan
from gpt_tp.hardware import mfu
from gpt_tp.model import GPTConfig


@contextmanager
def timing(module, name: str, device: torch.device):
    """module.<name> timed while inside: yields the list each call's seconds go to (device synced on both ends)."""
    original, times = getattr(module, name), []

    def wrapper(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        sync(device)
        times.append(time.perf_counter() - t0)
        return out

    setattr(module, name, wrapper)
    try:
        yield times
    finally:
        setattr(module, name, original)


def measure(spec: dict) -> None:
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.set_float32_matmul_precision("high")  # TF32 matmuls in "32-true", as build-nanogpt
    else:
        torch.set_num_threads(spec["threads"])
    dp, tp = spec["dp"], spec["tp"]
    mesh, device = torchrun_mesh(dp, tp, spec["device"])
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(**spec["config"])
    torch.manual_seed(spec["seed"])
    step = build(config, mesh, device, spec["compile"], spec["precision"], load_plan(spec["plan"], config),
                 spec.get("optimizer", "adamw"))
    dp_rank = mesh["data_parallel"].get_local_rank()
    B, T = spec["batch_size"], spec["seq_len"]
    data = SyntheticTokens(B, T, vocab=min(config.vocab_size, 50257), seed=spec["seed"], dp_rank=dp_rank, dp_size=dp)
    batches = [tuple(t.to(device) for t in data.batch(i)) for i in range(4)]

    times, warm, losses = [], [], []
    with timing(muon, "newton_schulz", device) as ns_times:  # Muon's Newton-Schulz, once per step
        for i in range(spec["warmup"] + spec["steps"]):
            x, y = batches[i % len(batches)]
            sync(device)
            t0 = time.perf_counter()
            loss = train_step(step, x, y, spec["precision"])
            sync(device)
            (times if i >= spec["warmup"] else warm).append(time.perf_counter() - t0)
            if i < spec["warmup"]:
                ns_times.clear()
            losses.append(loss)
    times = slowest(times, device).tolist()  # the step ends when the slowest rank ends
    ns_share = statistics.median(ns_times) / statistics.median(times) if ns_times else None
    losses = [l.float().item() for l in (losses[0], losses[-1])]
    mem = peak_memory(device)

    rec = CollectiveRecorder(groups_of(mesh))
    x, y = batches[0]
    try:
        with rec:
            train_step(step, x, y, spec["precision"])
        collectives = rec.summary()
    except Exception as e:  # noqa: BLE001 - e.g. a compiled region that cannot run under a dispatch mode
        collectives = {"error": f"{type(e).__name__}: {e}"[:300]}

    mems = [None] * world
    dist.all_gather_object(mems, mem)
    if rank == 0:
        tokens = B * T * dp
        tok_s = tokens / statistics.median(times)
        result = {
            **{k: spec[k] for k in ("name", "dp", "tp", "plan", "precision", "compile", "batch_size", "seq_len", "device",
                                    "threads")},
            "model": spec["model"],
            "world_size": world,
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "tokens_per_step": tokens,
            "step_time_s": stats(times),
            "step_times_s": times,
            "first_step_s": warm[0] if warm else None,  # with compile: compilation's time beside the step's
            "tokens_per_s": tok_s,
            "flops_per_token": config.flops_per_token(T),
            "peak_flops": spec["peak_flops"],
            "mfu": mfu(config.flops_per_token(T), tok_s, spec["peak_flops"], world),
            "peak_memory_bytes": mems,
            "collectives": collectives,
            "optimizer": spec.get("optimizer", "adamw"),
            "newton_schulz_share": ns_share,  # rank 0's Newton-Schulz time over the step time, medians
            "loss_first_last": losses,
        }
        Path(spec["result"]).write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m benchmarks.bench_worker", description=__doc__)
    ap.add_argument("spec", help="the run's spec file, written by python -m benchmarks.bench")
    spec = json.loads(Path(ap.parse_args(argv).spec).read_text())
    try:
        measure(spec)
    except BaseException as e:
        rank = os.environ.get("RANK", "0")
        Path(f"{spec['result']}.rank{rank}.error").write_text(f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())}")
        raise


if __name__ == "__main__":
    run(main)
