"""gpt_tp's training step (gpt_tp.train.step.TrainStep, the one GPTModule runs) without Lightning: the model built
and parallelized on a mesh, the step run on one batch (no host sync inside), for the benchmark and the audit, and
what the benchmark reads around it."""

import resource
import statistics
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

from benchmarks.plans import reduce_dtensor_partial_grads
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.parallel import TP_PLAN, materialize, parallelize, sync_grads
from gpt_tp.sizing.sizes import PRECISIONS
from gpt_tp.train.optim import AdamW, Muon, Schedule
from gpt_tp.train.step import TrainStep


def runs(precision: str) -> bool:
    """Whether this step runs a precision of gpt_tp.sizing.sizes.PRECISIONS: float32 weights, under bf16 autocast
    or none. 16-mixed needs a GradScaler, which the fused AdamW cannot have; the -true half precisions need half
    weights."""
    return precision in PRECISIONS and PRECISIONS[precision][0] == 4 and not precision.startswith("16")


def autocast_context(precision: str, device: torch.device):
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def _sync(model) -> None:
    """gpt_tp's gradient sync, after a reference plan's Partial gradients are reduced (benchmarks.plans)."""
    reduce_dtensor_partial_grads(model)
    sync_grads(model)


def build(config: GPTConfig, mesh, device: torch.device, compile: bool = False, precision: str = "32-true",
          plan: dict = TP_PLAN, optimizer: str = "adamw") -> TrainStep:
    """A GPT built on the meta device, parallelized with `plan` on the (data_parallel, tensor_parallel) mesh (TP ->
    compile -> FSDP2) and initialised shard by shard, in gpt_tp's training step with its optimizer (fused AdamW, or
    Muon + fused AdamW; lr 6e-4, no warmup)."""
    with torch.device("meta"):
        model = GPT(config)
    parallelize(model, mesh, compile=compile, param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
                plan=plan)
    materialize(model, device)
    model.train()
    return TrainStep(model, Muon() if optimizer == "muon" else AdamW(), Schedule(warmup_steps=0), sync=_sync)


def train_step(step: TrainStep, x, y, precision: str = "32-true", max_norm: float = 1.0, phase=None) -> torch.Tensor:
    """One optimizer step of `step` on the batch (x, y), under autocast for bf16-mixed; the gradients stay in place
    after it. Returns the loss tensor (no host sync). `phase(name)` is entered around "forward", "backward",
    "grad_sync_and_clip" and "optimizer" (the audit records each)."""
    phases = {} if phase is None else {"phase": phase}
    return step([(x, y)], 0, max_norm, partial(autocast_context, precision, x.device), **phases)[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: list[float], device: torch.device) -> torch.Tensor:
    """Each timing's slowest rank: one all-reduce (MAX) on the process group's device (NCCL takes no CPU tensor)."""
    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def peak_memory(device: torch.device) -> int:
    """Bytes: CUDA's max allocated on GPU; the process's max resident set size on CPU (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
