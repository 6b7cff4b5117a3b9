"""Measure what the planner estimates, on CPU: the bytes saved for backward by one forward (unique storages of the
tensors autograd saves, parameters left out), the parameter / gradient / AdamW bytes of one rank after a step, and
the peak of the memory allocated on the rank during one micro-batch of training.

The peak: the bytes of every tensor alive before a micro-batch (parameters, gradients of the micro-batch before it,
as under gradient accumulation, AdamW state, the batch), plus the largest rise above that during the micro-batch's
forward and backward, summed from the allocation and free records of the torch profiler (profile_memory); the least
such peak of six micro-batches.

Run under torchrun with nproc = dp * tp: one --case DP,TP,PRECISION,AC, or several whose DP x TP are all the number of
processes, measured one after another (what a case made is freed before the next; the meshes of the cases before
it stay, a (dp, tp) tensor of rank numbers each); rank 0 writes <out> as JSON: case -> the measured
and the planned numbers.
"""

import argparse
import gc
import json
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

from gpt_tp.sizing import AC_MODES, memory, sizes
from benchmarks.audit import measure_state_bytes
from gpt_tp.entry import run, torchrun_mesh
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.train.optim import AdamW
from gpt_tp.parallel import parallelize, sync_grads


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


def alive_bytes(model) -> int:
    """Bytes of every tensor storage Python can reach (parameters, AdamW state, the batch) and of the gradients
    (held by autograd, not by a Python object until read)."""
    gc.collect()  # autograd graphs left in reference cycles would otherwise be freed at random moments
    storages = {}
    for o in gc.get_objects() + [p.grad for p in model.parameters() if p.grad is not None]:
        if torch.is_tensor(o) and not o.is_meta:
            s = _local(o).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def rise_in(prof, window: str) -> int:
    """The largest rise of allocated bytes above their level at the start of the record_function(window) span,
    from the profiler's allocation and free records. (Frees that happen on gloo's own threads are not recorded,
    so the level before the span is not a measure of what is alive; alive_bytes is.)"""
    events = prof.profiler.kineto_results.events()
    span = next(e for e in events if e.name() == window)
    start, end = span.start_ns(), span.start_ns() + span.duration_ns()
    alive = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]" and start <= e.start_ns() <= end), key=lambda e: e.start_ns()):
        alive += e.nbytes()
        peak = max(peak, alive)
    return peak


def measure(mesh, dp: int, tp: int, precision: str, ac: str, layers: int, n_embd: int) -> dict:
    """One case on this mesh: the measured and the planned numbers (every tensor it made is gone when it returns)."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=layers, n_head=4, n_embd=n_embd, block_size=128, vocab_size=2048)
    B, T = 4, 128
    bf16 = precision == "bf16-mixed"
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    x = torch.randint(0, config.vocab_size, (B, T))
    y = torch.randint(0, config.vocab_size, (B, T))

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        # as GPTModule.configure_model builds it for training: FSDP2 gathers in bf16 under bf16-mixed
        model = parallelize(GPT(config), mesh, param_dtype=torch.bfloat16 if bf16 else None, activation_checkpointing=ac)
        opt = AdamW().build(model, 1e-3)
        saved = SavedBytes(model)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), cast:
            loss = cross_entropy(model(x), y)
        loss.backward()
        sync_grads(model)
        opt.step()
        states = measure_state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        peaks = []
        for window in ("first", *(f"peak{i}" for i in range(1, 7))):  # micro-batches of one accumulation: all but the
            before = alive_bytes(model)                                    # first see the gradients of the ones before
            peaks.append((before, window))
            with record_function(window):
                with cast:
                    loss = cross_entropy(model(x), y)
                loss.backward()
                del loss
    # the least of six micro-batches: a free on one of gloo's threads goes unrecorded and only ever adds
    peak = min(before + rise_in(prof, window) for before, window in peaks[1:])

    planned_act = memory.activation_bytes(config, B, T, tp, precision, dp=dp, ac=ac)
    planned_states = sizes.state_bytes(config, dp, tp, 4)  # float32 parameters in both precisions
    planned = memory.memory_per_device(config, dp, tp, B, T, precision, ac=ac, overhead_gib=0)
    return {
        "measured": {"activations": saved.total, "peak": peak, **{k: states[k] for k in ("params", "grads", "optimizer")}},
        "planned": {"activations": sum(planned_act.values()), "peak": planned.total, **planned_states},
        "planned_terms": {**planned_act, "transient": planned.transient},
        "n_saved_storages": len(saved.storages),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", required=True, metavar="DP,TP,PRECISION,AC",
                    help="a layout, precision (32-true, bf16-mixed) and activation checkpointing mode to measure; "
                    "repeatable: the cases run one after another in these processes (DP x TP = the processes)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = {}
    for case in args.case:
        dp, tp, precision, ac = case.split(",")
        assert precision in ("32-true", "bf16-mixed") and ac in AC_MODES, case
        mesh, _ = torchrun_mesh(int(dp), int(tp), "cpu")
        results[case] = measure(mesh, int(dp), int(tp), precision, ac, args.layers, args.n_embd)
        gc.collect()  # the case's model, optimizer and autograd graphs: not alive in the next case's readings
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    run(main)  # ends the process group before exit
