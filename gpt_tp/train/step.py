"""gpt_tp's training step, read top to bottom (docs/train.md, "The training step"): one optimizer step's phases,
TrainStep's methods in this order, and the Lightning hook of GPTModule that hands over to each.

    1. begin(step)       this step's lr and optimizer settings          GPTModule.training_step
    2. loss(x, y)        each micro-batch's loss; backward of loss / n   training_step; Lightning (fp16: scaled)
    3. sync()            the gradient sync, after the last backward      GPTModule.backward
    4. check(...)        the global norm and the DP-mean loss in one     on_before_optimizer_step (and logged)
                         host sync; a non-finite one stops the run
    5. clip(max_norm)    by that norm (trainer.gradient_clip_val)        configure_gradient_clipping
    6. optimizer.step()                                                  Lightning's (fp16: the scaler's)

TrainStep.__call__ runs 1-6 without Lightning (--simulate, the benchmarks), but for check: no host sync, clip takes
the norm.
"""

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

from gpt_tp.parallel import clip_grad_norm, grad_norm, sync_grads
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.train.optim import AdamW, Schedule


class TrainStep:
    """The step's phases on one model and its optimizer (`optimizer.build`). sync: the gradient sync; loss_fn:
    (logits, targets) -> loss, the vocab-parallel cross-entropy unless given (GPTModule passes compute_loss)."""

    def __init__(self, model: nn.Module, optimizer: AdamW = AdamW(), schedule: Schedule = Schedule(),
                 sync: Callable[[nn.Module], object] = sync_grads, loss_fn: Callable = cross_entropy):
        self.model, self.settings, self.schedule, self._sync, self._loss_fn = model, optimizer, schedule, sync, loss_fn
        self.optimizer = optimizer.build(model, schedule.max_lr)
        self._loss_sum, self._norm = None, None  # the micro-batches' losses since begin; the step's grad norm

    def begin(self, step: int) -> None:
        """Optimizer step `step` (0-based) starts: its lr and the settings go on the optimizer's groups."""
        self.settings.apply(self.optimizer, self.schedule.lr(step), self.schedule.max_lr)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss (the logits go as soon as it is taken), summed for check."""
        loss = self._loss_fn(self.model(x), y)
        self._loss_sum = loss.detach() if self._loss_sum is None else self._loss_sum + loss.detach()
        return loss

    def sync(self) -> None:
        """After the last micro-batch's backward: from then on every gradient is the model's true one (a hook after
        it, a callback's on_before_optimizer_step included, reads them)."""
        self._sync(self.model)

    def check(self, step: int, micro_batches: int, dp: int = 1, dp_group=None,
              overflow_ok: bool = False) -> tuple[float, float]:
        """The global grad norm and the micro-batches' mean loss, averaged over the `dp` ranks of dp_group, in the
        step's one host sync; a non-finite one raises (before the optimizer step and any save). overflow_ok: fp16's
        inf norm is its gradient scaler's overflow (it skips the step, lowers its scale)."""
        self._norm = grad_norm(self.model)
        loss, self._loss_sum = self._loss_sum / micro_batches, None
        if dp > 1:
            dist.all_reduce(loss, group=dp_group)  # in place: `loss` is this step's own tensor
            loss = loss / dp
        loss, norm = torch.stack([loss, self._norm.float()]).tolist()
        if not (math.isfinite(loss) and (math.isfinite(norm) or overflow_ok)):
            raise RuntimeError(f"non-finite training at step {step}: loss={loss}, grad_norm={norm}. The run is stopped "
                               "so no checkpoint holds NaNs; resume from the last good checkpoint with a lower "
                               "model.max_lr, check the data, or use bf16 rather than fp16 precision.")
        return loss, norm

    def clip(self, max_norm: float | None) -> torch.Tensor:
        """Scale the gradients down to max_norm (None: no clipping) by check's norm (taken here without check).
        Returns the norm."""
        norm, self._norm = clip_grad_norm(self.model, max_norm, self._norm), None
        return norm

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], step: int, max_norm: float | None = 1.0,
                 autocast=nullcontext, phase=lambda name: nullcontext()) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step without Lightning, as Lightning runs it (gradients zeroed first). Returns (mean loss, grad norm) as tensors; the gradients stay. `phase(name)` is entered around "forward",
        "backward", "grad_sync_and_clip" and "optimizer"."""
        self.optimizer.zero_grad(set_to_none=True)
        self.begin(step)
        for x, y in batches:
            with phase("forward"), autocast():
                loss = self.loss(x, y) / len(batches)  # Lightning's accumulation: each micro-batch's share
            with phase("backward"):
                loss.backward()
        with phase("grad_sync_and_clip"):
            self.sync()
            norm = self.clip(max_norm)
        with phase("optimizer"):
            self.optimizer.step()
        loss, self._loss_sum = self._loss_sum / len(batches), None
        return loss, norm
