"""gpt_tp's training step, read top to bottom (docs/train.md, "The training step"): TrainStep's methods in the order
one optimizer step runs them, and the GPTModule hook that hands over to each under Lightning.

    begin(step)       the coming step's lr and optimizer settings      on_train_start, on_train_batch_end (before
                                                                       Lightning's callbacks read them)
    loss(x, y, last)  per micro-batch; Lightning runs backward(loss/n)  training_step (fp16: the loss scaled)
    sync()            the gradient sync, after the last backward        backward
    check(...)        norm, DP-mean loss, callbacks' flags: one all-     on_before_optimizer_step (then logged)
                      reduce, one host sync; a non-finite one stops
    clip(max_norm)    by that norm, at trainer.gradient_clip_val        configure_gradient_clipping
    optimizer.step()                                                    Lightning's (fp16: the scaler's)

__call__ runs them without Lightning (--simulate, the benchmarks), but for check's host sync."""

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from gpt_tp.parallel import clip_grad_norm, grad_norm, sync_grads
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.train.optim import AdamW, Schedule


class TrainStep:
    """The step's phases on one model and the optimizer `optimizer.build` makes. sync: the gradient sync; loss_fn:
    (logits, targets) -> loss, the vocab-parallel cross-entropy unless given; fp16: an inf norm is the gradient
    scaler's overflow (it skips the step, lowers its scale), no failure."""

    def __init__(self, model: nn.Module, optimizer: AdamW = AdamW(), schedule: Schedule = Schedule(),
                 sync: Callable[[nn.Module], object] = sync_grads, loss_fn: Callable = cross_entropy, fp16: bool = False):
        self.model, self.settings, self.schedule, self.fp16 = model, optimizer, schedule, fp16
        self._sync, self._loss_fn = sync, loss_fn
        self.optimizer = optimizer.build(model, schedule.max_lr)
        self._loss_sum, self._norm = None, None  # this step's micro-batch losses, summed; its grad norm (check's)

    def begin(self, step: int) -> None:
        self.settings.apply(self.optimizer, self.schedule.lr(step), self.schedule.max_lr)

    def loss(self, x: torch.Tensor, y: torch.Tensor, last: bool | None = None) -> torch.Tensor:
        if last is not None and isinstance(self.model, FSDPModule):  # Run.sync_once: only the last one reduce-scatters
            self.model.set_requires_gradient_sync(last)
        loss = self._loss_fn(self.model(x), y)  # the logits go as soon as the loss is taken
        self._loss_sum = loss.detach() if self._loss_sum is None else self._loss_sum + loss.detach()
        return loss

    def sync(self) -> None:
        """From here every gradient is the model's true one (so is what a callback's hook reads)."""
        self._sync(self.model)

    def check(self, step: int, micro_batches: int, flags: list[float] = ()) -> tuple[float, float, list[float]]:
        """(mean loss over the micro-batches and DP ranks, global grad norm, `flags` summed over every rank): floats, from
        one all-reduce and one host sync. GPTModule sums its callbacks' step_flags(trainer), hands back flags_summed."""
        loss, self._loss_sum = self._loss_sum.float() / micro_batches, None
        # each flag filled on the device (a kernel argument): a host list copied to a GPU would wait for its stream
        carry = torch.stack([loss, *(torch.full((), float(f), device=loss.device) for f in flags)])
        self._norm = grad_norm(self.model, carry)
        norm, loss, *flags = torch.cat([self._norm.float().reshape(1), carry]).tolist()  # the step's one host sync
        loss /= dist.get_world_size() if dist.is_initialized() else 1  # tensor-parallel ranks hold the same loss
        if not (math.isfinite(loss) and (math.isfinite(norm) or self.fp16)):
            raise RuntimeError(f"non-finite training at step {step}: loss={loss}, grad_norm={norm}. The run is stopped "
                               "so no checkpoint holds NaNs; resume from the last good checkpoint with a lower "
                               "model.max_lr, check the data, or use bf16 rather than fp16 precision.")
        return loss, norm, flags

    def clip(self, max_norm: float | None) -> torch.Tensor:
        """Returns the norm: check's, or taken here."""
        norm, self._norm = clip_grad_norm(self.model, max_norm, self._norm), None
        return norm

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], step: int, max_norm: float | None = 1.0,
                 autocast=nullcontext, phase=lambda name: nullcontext(),
                 sync_once: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step, gradients zeroed first. Returns (mean loss, grad norm) as tensors; the gradients stay.
        `phase(name)` is entered around "forward", "backward", "grad_sync_and_clip", "optimizer"; sync_once: Run's."""
        self.optimizer.zero_grad(set_to_none=True)
        self.begin(step)
        for i, (x, y) in enumerate(batches):
            with phase("forward"), autocast():
                loss = self.loss(x, y, i == len(batches) - 1 if sync_once else None) / len(batches)  # Lightning's accumulation
            with phase("backward"):
                loss.backward()
        with phase("grad_sync_and_clip"):
            self.sync()
            norm = self.clip(max_norm)
        with phase("optimizer"):
            self.optimizer.step()
        loss, self._loss_sum = self._loss_sum / len(batches), None
        return loss, norm
