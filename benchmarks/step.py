"""One training step as gpt_tp.train.module runs it, without Lightning: the model built and parallelized on a mesh,
the step itself (no host sync inside), used by the benchmark and the audit, and what the benchmark reads around it."""

import resource
import statistics
from contextlib import nullcontext

import torch

from benchmarks.plans import reduce_dtensor_partial_grads
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.parallel import TP_PLAN, clip_grad_norm, materialize, parallelize
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.sizing.sizes import PRECISIONS
from gpt_tp.train.optim import make_optimizer


def runs(precision: str) -> bool:
    """Whether this step runs a precision of gpt_tp.sizing.sizes.PRECISIONS: float32 weights, under bf16 autocast
    or none. 16-mixed needs a GradScaler, which the fused AdamW cannot have; the -true half precisions need half
    weights."""
    return precision in PRECISIONS and PRECISIONS[precision][0] == 4 and not precision.startswith("16")


def autocast_context(precision: str, device: torch.device):
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def build(config: GPTConfig, mesh, device: torch.device, compile: bool = False, precision: str = "32-true",
          plan: dict = TP_PLAN, optimizer: str = "adamw"):
    """A GPT built on the meta device, parallelized with `plan` on the (data_parallel, tensor_parallel) mesh (TP ->
    compile -> FSDP2) and initialised shard by shard, with its optimizer (fused AdamW, or Muon + fused AdamW)."""
    with torch.device("meta"):
        model = GPT(config)
    parallelize(model, mesh, compile=compile, param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
                plan=plan)
    materialize(model, device)
    model.train()
    return model, make_optimizer(model, optimizer, lr=6e-4, fused=True)


def train_step(model, opt, x, y, precision: str = "32-true", max_norm: float = 1.0, phase=nullcontext) -> torch.Tensor:
    """The training step gpt_tp.train.module runs, without Lightning: gradients zeroed (as Lightning does before
    the step), forward (under autocast for bf16-mixed) with the vocab-parallel cross-entropy, backward, the
    gradient sync and clip at max_norm (a plan's Partial gradients reduced first: benchmarks.plans), the optimizer
    step. The gradients stay in place after it. Returns the loss tensor (no host sync). `phase(name)` is entered
    around each part: "forward", "backward", "grad_sync_and_clip", "optimizer" (the audit records each)."""
    opt.zero_grad(set_to_none=True)
    with phase("forward"):
        with autocast_context(precision, x.device):
            logits = model(x)
        loss = cross_entropy(logits, y)
        del logits
    with phase("backward"):
        loss.backward()
    with phase("grad_sync_and_clip"):
        reduce_dtensor_partial_grads(model)
        clip_grad_norm(model, max_norm)
    with phase("optimizer"):
        opt.step()
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
