"""gpt_tp's training step: the one GPTModule runs through Lightning's hooks, `--simulate` on fake tensors and the
benchmarks without Lightning (docs/train.md, "The training step")."""

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn as nn

from gpt_tp.parallel import clip_grad_norm, sync_grads
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.train.optim import OptimizerSettings


class TrainStep:
    """The step's parts on one model and its optimizer (settings.build). sync: the gradient sync after the last
    backward (from then on every gradient is the model's true one); loss_fn: (logits, targets) -> loss, the
    vocab-parallel cross-entropy unless given (GPTModule passes its compute_loss hook)."""

    def __init__(self, model: nn.Module, settings: OptimizerSettings,
                 sync: Callable[[nn.Module], object] = sync_grads, loss_fn: Callable = cross_entropy):
        self.model, self.settings, self.sync, self._loss_fn = model, settings, sync, loss_fn
        self.optimizer = settings.build(model)

    def begin(self, step: int) -> None:
        """Optimizer step `step` starts: its hyper-parameters go on the optimizer."""
        self.settings.apply(self.optimizer, step)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(self.model(x), y)  # the logits go as soon as the loss is taken

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], step: int, max_norm: float | None = 1.0,
                 autocast=nullcontext, phase=lambda name: nullcontext()) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step without Lightning, as Lightning runs it: gradients zeroed, the micro-batches' mean loss
        backward, sync, clip, step. Returns (mean loss, grad norm) as tensors (no host sync); the gradients stay.
        `phase(name)` is entered around "forward", "backward", "grad_sync_and_clip" and "optimizer"."""
        self.optimizer.zero_grad(set_to_none=True)
        self.begin(step)
        total = 0.0
        for x, y in batches:
            with phase("forward"), autocast():
                loss = self.loss(x, y) / len(batches)  # Lightning's accumulation: each micro-batch's share
            with phase("backward"):
                loss.backward()
            total = total + loss.detach()
        with phase("grad_sync_and_clip"):
            self.sync(self.model)
            norm = clip_grad_norm(self.model, max_norm)
        with phase("optimizer"):
            self.optimizer.step()
        return total, norm
