"""Optimizer and learning-rate schedule (build-nanogpt's defaults): OptimizerSettings builds the optimizer and sets
each step's hyper-parameters on it."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from gpt_tp.errors import UserError


def get_lr(step: int, max_lr: float = 6e-4, min_lr: float = 6e-5, warmup_steps: int = 715, max_steps: int = 19073) -> float:
    """The lr at optimizer step `step` (0-based), build-nanogpt's: linear warmup to max_lr, cosine decay to min_lr at
    max_steps, then min_lr (also right after the warmup when max_steps <= warmup_steps)."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:  # the cosine ends at min_lr exactly (cos(pi) = -1): the same value, and no 0 / 0
        return min_lr
    decay_ratio = (step - warmup_steps) / (max_steps - warmup_steps)  # 0 -> 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


def check_optimizer(max_lr: float, min_lr: float, warmup_steps: int, max_steps: int, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
    """The schedule and AdamW values a run can train with; a bad one is refused in one line naming its flag."""
    if not (max_lr > 0 and 0 <= min_lr <= max_lr and warmup_steps >= 0):
        raise UserError(f"model.max_lr={max_lr}, model.min_lr={min_lr}, model.warmup_steps={warmup_steps}: "
                        "need max_lr > 0, 0 <= min_lr <= max_lr and warmup_steps >= 0")
    if max_steps < 1:
        raise UserError(f"trainer.max_steps={max_steps}: give the run's length in optimizer steps (>= 1); it is also "
                        "the length of the learning-rate schedule")
    if not (weight_decay >= 0 and all(0 <= b < 1 for b in betas) and eps > 0):
        raise UserError(f"model.weight_decay={weight_decay}, model.betas={list(betas)}, model.eps={eps}: AdamW needs "
                        "weight_decay >= 0, each beta in [0, 1) and eps > 0")


def fused_with_scaler(fused: bool | None, grad_scaler: bool) -> bool | None:
    """model.fused under fp16 (grad_scaler): never fused, as Lightning would clip a fused AdamW's scaled gradients."""
    if grad_scaler and fused:
        raise UserError("model.fused=true cannot train with trainer.precision=16-mixed: the gradients would be clipped "
                        "before the gradient scaler unscales them; set model.fused=null, or use trainer.precision=bf16-mixed")
    return False if grad_scaler else fused


def make_adamw(model: nn.Module, lr: float, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
               eps: float = 1e-8, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on >= 2-D parameters only (matmul weights and embeddings; not biases or LayerNorms);
    fused=None uses the fused kernel where the parameters' device has one. Plain or DTensor parameters, not mixed."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied wte/lm_head appears once
    fused = all(p.device.type in ("cuda", "cpu", "xpu", "mps") for p in params) if fused is None else fused
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


@dataclass(frozen=True)
class OptimizerSettings:
    """One run's optimizer and schedule (GPTModule's hparams of the same names); checked when made."""

    max_lr: float = 6e-4  # the schedule's peak, after warmup_steps
    min_lr: float = 6e-5  # the cosine's end, at max_steps and after
    warmup_steps: int = 715
    max_steps: int = 19073  # the schedule's length in optimizer steps (trainer.max_steps)
    weight_decay: float = 0.1  # on >= 2-D parameters only
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    fused: bool | None = None  # fused AdamW; None: where the device has it

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))  # a checkpoint's hparams may hold a list
        check_optimizer(self.max_lr, self.min_lr, self.warmup_steps, self.max_steps, self.weight_decay, self.betas,
                        self.eps)

    def lr(self, step: int) -> float:
        return get_lr(step, self.max_lr, self.min_lr, self.warmup_steps, self.max_steps)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer of gpt_tp's training step, the one way it is made."""
        return make_adamw(model, self.max_lr, self.weight_decay, self.betas, self.eps, self.fused)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Optimizer step `step` (0-based)'s lr, betas, eps and weight decay on every group: these settings hold even
        where a resumed optimizer's groups came back with the saved run's."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            decays = group["params"][0].dim() >= 2  # build's groups: >= 2-D parameters decay, the others not
            group.update(lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay if decays else 0.0)
