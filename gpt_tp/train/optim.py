"""The run's optimizer, a class --model.optimizer chooses (AdamW, the default, or Muon on the block matrices; its
fields: --model.optimizer.<field>), and the warmup + cosine learning-rate schedule both follow."""

import dataclasses
import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from gpt_tp.errors import UserError
from gpt_tp.model import BLOCK_MATRICES
from gpt_tp.train.muon import ShardedMuon


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


@dataclass(frozen=True)
class Schedule:
    """The lr schedule, per optimizer step (GPTModule's model.max_lr, min_lr, warmup_steps; trainer.max_steps)."""

    max_lr: float = 6e-4  # the peak, after warmup_steps
    min_lr: float = 6e-5  # the cosine's end, at max_steps and after
    warmup_steps: int = 715
    max_steps: int = 19073  # the schedule's length in optimizer steps (trainer.max_steps)

    def __post_init__(self):
        if not (self.max_lr > 0 and 0 <= self.min_lr <= self.max_lr and self.warmup_steps >= 0):
            raise UserError(f"model.max_lr={self.max_lr}, model.min_lr={self.min_lr}, model.warmup_steps="
                            f"{self.warmup_steps}: need max_lr > 0, 0 <= min_lr <= max_lr and warmup_steps >= 0")
        if self.max_steps < 1:
            raise UserError(f"trainer.max_steps={self.max_steps}: give the run's length in optimizer steps (>= 1); it "
                            "is also the length of the learning-rate schedule")

    def lr(self, step: int) -> float:
        return get_lr(step, self.max_lr, self.min_lr, self.warmup_steps, self.max_steps)


def is_muon_weight(name: str) -> bool:
    """A block's 2-D weight Muon takes (transformer.h.<i>.<one of BLOCK_MATRICES>; c_attn is one [3C, C] matrix)."""
    parts = name.split(".", 3)
    return parts[:2] == ["transformer", "h"] and parts[-1] in BLOCK_MATRICES


class Optimizer:
    """What --model.optimizer names: a class below (jsonargparse's class_path; a plain base, so its dataclasses are
    chosen by name). A run's hparams and checkpoints record it as plain data (hparam, optimizer_from)."""

    @property
    def kind(self) -> str:  # how gpt_tp.sizing names it ("adamw", "muon") to count its state
        return type(self).__name__.lower()

    def hparam(self) -> dict:
        """{"class_path", "init_args"}: plain data for torch.load(weights_only=True), and jsonargparse's own form."""
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": dataclasses.asdict(self)}


def optimizer_from(spec: "Optimizer | dict") -> "Optimizer":
    """The optimizer an hparam (Optimizer.hparam, a parsed config's --model.optimizer as a dict) names, or `spec`."""
    if isinstance(spec, Optimizer):
        return spec
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


@dataclass(frozen=True)
class AdamW(Optimizer):
    """build-nanogpt's AdamW (the default) at the schedule's lr; checked when made.

    Args:
        weight_decay: decoupled, on parameters of 2 or more dimensions only (matmul weights, embeddings).
        betas: AdamW's.
        eps: AdamW's.
        fused: the fused kernel; None: where the device has it (never under trainer.precision=16-mixed).
    """

    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    fused: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))  # a checkpoint's hparams may hold a list
        if not (self.weight_decay >= 0 and all(0 <= b < 1 for b in self.betas) and self.eps > 0):
            raise UserError(f"model.optimizer.weight_decay={self.weight_decay}, model.optimizer.betas="
                            f"{list(self.betas)}, model.optimizer.eps={self.eps}: AdamW needs weight_decay >= 0, each "
                            "beta in [0, 1) and eps > 0")

    def groups(self, params: list) -> list[dict]:  # build-nanogpt's: weight decay on >= 2-D parameters only
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def is_fused(self, params: list) -> bool:
        return all(p.device.type in ("cuda", "cpu", "xpu", "mps") for p in params) if self.fused is None else self.fused

    def build(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """The run's one optimizer on the trainable parameters (the tied wte/lm_head once), plain or DTensor."""
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(self.groups(params), lr=lr, betas=self.betas, eps=self.eps, fused=self.is_fused(params))

    def apply(self, optimizer: torch.optim.Optimizer, lr: float, max_lr: float) -> None:
        """Optimizer step's lr (the schedule's at that step, peak max_lr), betas, eps and weight decay on every AdamW
        group: these settings hold even where a resumed optimizer's groups came back with the saved run's."""
        for group in optimizer.param_groups:
            if not group.get("muon"):
                decays = group["params"][0].dim() >= 2  # build's groups: >= 2-D parameters decay, the others not
                group.update(lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay if decays else 0.0)


@dataclass(frozen=True)
class Muon(AdamW):
    """Muon on the blocks' 2-D weights, AdamW (the fields above, at the schedule's lr) on the rest, in one optimizer.

    torch.optim.Muon's update on the weights is_muon_weight names, sharded (gpt_tp.train.muon).

    Args:
        lr: Muon's peak lr, on the same warmup + cosine multiplier as model.max_lr.
        fp32: Newton-Schulz in float32 rather than torch.optim.Muon's bfloat16 (for parity tests).
    """

    lr: float = 0.02
    fp32: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not self.lr >= 0:
            raise UserError(f"model.optimizer.lr={self.lr}: Muon's peak learning rate must be >= 0 (default 0.02)")

    def build(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """ShardedMuon: AdamW's groups first, then the block matrices' with "muon": True."""
        params = [p for p in model.parameters() if p.requires_grad]
        matrices = {id(p) for n, p in model.named_parameters() if is_muon_weight(n) and p.dim() == 2}
        if not matrices:
            raise UserError("model.optimizer=Muon: this model has no 2-D block weights (transformer.h.N.attn.c_attn, "
                            "attn.c_proj, mlp.c_fc, mlp.c_proj) for Muon; use model.optimizer=AdamW")
        muon = {"params": [p for p in model.parameters() if id(p) in matrices], "lr": self.lr,
                "weight_decay": self.weight_decay, "muon": True}
        opt = ShardedMuon(self.groups([p for p in params if id(p) not in matrices]) + [muon],
                          ns_dtype=torch.float32 if self.fp32 else torch.bfloat16, lr=lr, betas=self.betas,
                          eps=self.eps, fused=self.is_fused(params))
        rank_zero_info(opt.describe({p: n for n, p in model.named_parameters() if id(p) in matrices}))
        return opt

    def apply(self, optimizer: torch.optim.Optimizer, lr: float, max_lr: float) -> None:
        """AdamW's groups as AdamW sets them; the Muon group: its lr on the same multiplier, and weight decay."""
        super().apply(optimizer, lr, max_lr)
        for group in optimizer.param_groups:
            if group.get("muon"):
                group.update(lr=lr / max_lr * self.lr, weight_decay=self.weight_decay)
