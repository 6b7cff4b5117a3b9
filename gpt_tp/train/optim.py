"""OptimizerSettings: the run's optimizer (build-nanogpt's AdamW, or Muon on the block matrices) and lr schedule."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from gpt_tp.errors import UserError
from gpt_tp.parallel.muon import Muon
from gpt_tp.sizing.sizes import MUON_WEIGHTS

OPTIMIZERS = ("adamw", "muon")


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


def is_muon_weight(name: str) -> bool:
    """A block's 2-D weight Muon takes (transformer.h.<i>.<one of MUON_WEIGHTS>; c_attn is one [3C, C] matrix)."""
    parts = name.split(".", 3)
    return parts[:2] == ["transformer", "h"] and parts[-1] in MUON_WEIGHTS


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
    optimizer: str = "adamw"  # "adamw", or "muon" on the block matrices (is_muon_weight) with AdamW on the rest
    muon_lr: float = 0.02  # Muon's peak, on the same warmup + cosine multiplier as max_lr
    muon_fp32: bool = False  # Newton-Schulz in float32 rather than torch.optim.Muon's bfloat16 (for tests)

    def __post_init__(self):
        """The schedule and optimizer values a run can train with; a bad one is refused in one line naming its flag."""
        object.__setattr__(self, "betas", tuple(self.betas))  # a checkpoint's hparams may hold a list
        if not (self.max_lr > 0 and 0 <= self.min_lr <= self.max_lr and self.warmup_steps >= 0):
            raise UserError(f"model.max_lr={self.max_lr}, model.min_lr={self.min_lr}, model.warmup_steps="
                            f"{self.warmup_steps}: need max_lr > 0, 0 <= min_lr <= max_lr and warmup_steps >= 0")
        if self.max_steps < 1:
            raise UserError(f"trainer.max_steps={self.max_steps}: give the run's length in optimizer steps (>= 1); it "
                            "is also the length of the learning-rate schedule")
        if not (self.weight_decay >= 0 and all(0 <= b < 1 for b in self.betas) and self.eps > 0):
            raise UserError(f"model.weight_decay={self.weight_decay}, model.betas={list(self.betas)}, model.eps="
                            f"{self.eps}: AdamW needs weight_decay >= 0, each beta in [0, 1) and eps > 0")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"model.optimizer={self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        if not self.muon_lr >= 0:
            raise UserError(f"model.muon_lr={self.muon_lr}: Muon's peak learning rate must be >= 0 (default 0.02)")

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        """The run's one optimizer: AdamW, weight decay on >= 2-D parameters only (matmul weights, embeddings); with
        "muon", gpt_tp.parallel.muon.Muon: AdamW's groups first, then the block matrices' with "muon": True.
        Plain or DTensor parameters, not mixed."""
        params = [p for p in model.parameters() if p.requires_grad]  # the tied wte/lm_head appears once
        has_kernel = all(p.device.type in ("cuda", "cpu", "xpu", "mps") for p in params)
        fused = has_kernel if self.fused is None else self.fused
        muon = self.optimizer == "muon"
        matrices = {id(p) for n, p in model.named_parameters() if muon and is_muon_weight(n) and p.dim() == 2}
        if muon and not matrices:
            raise UserError("model.optimizer=muon: this model has no 2-D block weights (transformer.h.N.attn.c_attn, "
                            "attn.c_proj, mlp.c_fc, mlp.c_proj) for Muon; use model.optimizer=adamw")
        params = [p for p in params if id(p) not in matrices]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        if not matrices:
            return torch.optim.AdamW(groups, lr=self.max_lr, betas=self.betas, eps=self.eps, fused=fused)
        groups.append({"params": [p for p in model.parameters() if id(p) in matrices], "lr": self.muon_lr,
                       "weight_decay": self.weight_decay, "muon": True})
        ns_dtype = torch.float32 if self.muon_fp32 else torch.bfloat16
        return Muon(groups, ns_dtype=ns_dtype, lr=self.max_lr, betas=self.betas, eps=self.eps, fused=fused)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Optimizer step `step` (0-based)'s lr, betas, eps and weight decay on every group (a Muon group: its lr,
        muon_lr on the same multiplier, and weight decay): these settings hold even where a resumed optimizer's groups
        came back with the saved run's."""
        lr = get_lr(step, self.max_lr, self.min_lr, self.warmup_steps, self.max_steps)
        for group in optimizer.param_groups:
            if group.get("muon"):
                group.update(lr=lr / self.max_lr * self.muon_lr, weight_decay=self.weight_decay)
                continue
            decays = group["params"][0].dim() >= 2  # build's groups: >= 2-D parameters decay, the others not
            group.update(lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay if decays else 0.0)
