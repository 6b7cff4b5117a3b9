"""One training step as gpt_tp.train.module runs it, without Lightning: the model built and parallelized on a mesh,
the step itself (no host sync inside), and what the benchmark reads around it."""

import resource
import statistics
from contextlib import nullcontext

import torch

from gpt_tp.model import GPT, GPTConfig
from gpt_tp.parallel import clip_grad_norm, materialize, parallelize
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.train.optim import make_adamw


def autocast_context(precision: str, device: torch.device):
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def build(config: GPTConfig, mesh, device: torch.device, compile: bool, precision: str = "32-true"):
    """A GPT built on the meta device, parallelized on the (data_parallel, tensor_parallel) mesh (TP -> compile ->
    FSDP2) and initialised shard by shard, with its fused AdamW."""
    with torch.device("meta"):
        model = GPT(config)
    parallelize(model, mesh, compile=compile, param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None)
    materialize(model, device)
    model.train()
    return model, make_adamw(model, lr=6e-4, fused=True)


def train_step(model, opt, x, y, precision: str, max_norm: float = 1.0) -> torch.Tensor:
    """The training step gpt_tp.train.module runs, without Lightning: returns the loss tensor (no host sync)."""
    with autocast_context(precision, x.device):
        logits = model(x)
    loss = cross_entropy(logits, y)
    loss.backward()
    clip_grad_norm(model, max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> int:
    """Bytes: CUDA's max allocated on GPU; the process's max resident set size on CPU (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
