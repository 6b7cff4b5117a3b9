"""The styles of TP_PLAN: parameters are DTensors on the TP mesh, but each block computes on their local shards with
explicit functional collectives along dim 0, token-major where that saves a copy (docs/performance.md, "The layout")."""

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from gpt_tp.torch_internals import FUNCTIONAL as _C10D


def all_gather_rows(x: torch.Tensor, n: int, group: str) -> torch.Tensor:
    """(B, ...) on each of n ranks -> (n B, ...), rank-major. Backward: reduce-scatter."""
    return _C10D.wait_tensor(_C10D.all_gather_into_tensor(x.contiguous(), n, group))


def reduce_scatter_rows(x: torch.Tensor, n: int, group: str) -> torch.Tensor:
    """(n B, ...) partial sums -> (B, ...), rank r's rows summed over ranks. Backward: all-gather."""
    return _C10D.wait_tensor(_C10D.reduce_scatter_tensor(x.contiguous(), "sum", n, group))


def to_token_major(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, ...) in order -> (n B, T/n, ...): row block r holds positions [r T/n, (r+1) T/n) of every sequence."""
    B, T = x.shape[:2]
    return x.reshape(B, n, T // n, *x.shape[2:]).transpose(0, 1).reshape(n * B, T // n, *x.shape[2:])  # copy


def to_sequence_order(x: torch.Tensor, n: int) -> torch.Tensor:
    """(n B, T/n, ...) token-major -> (B, T, ...) in order."""
    B, t = x.shape[0] // n, x.shape[1]
    return x.reshape(n, B, t, *x.shape[2:]).transpose(0, 1).reshape(B, n * t, *x.shape[2:])  # copy


def cast_for_matmul(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, LayerNorm outputs float32 but the matmul after it runs in bf16: cast before an all-gather,
    so the gather (and its backward reduce-scatter) moves 2-byte elements. Same forward numbers."""
    on = torch.is_autocast_enabled(x.device.type) and x.is_floating_point()
    return x.to(torch.get_autocast_dtype(x.device.type)) if on else x


class _TP:
    """What a local module needs of its TP group, fixed when the plan is applied (plain values: compile-friendly)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh, self.n, self.rank = mesh, mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group().group_name


def _local(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.to_local()


class _RowParallel(torch.autograd.Function):
    """Row-parallel: x W^T (partial sums over this rank's K slice) reduce-scattered into this rank's (B, T/n, C) slice,
    plus b. reorder_input: x is attention's (B, T, K) output, made token-major by a copy backward redoes, not keeps."""

    @staticmethod
    def forward(ctx, x, w, b, n: int, group: str, reorder_input: bool) -> torch.Tensor:
        y = F.linear(to_token_major(x, n) if reorder_input else x, w)  # (n B, T/n, C)
        out = reduce_scatter_rows(y, n, group)  # (B, T/n, C)
        if b is not None:
            out.add_(b.to(out.dtype))  # in place: the scattered slice is ours
        ctx.save_for_backward(x, w)
        ctx.n, ctx.group, ctx.reorder_input, ctx.dtype, ctx.x_dtype = n, group, reorder_input, y.dtype, x.dtype
        ctx.b_dtype = None if b is None else b.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        n, dtype = ctx.n, ctx.dtype
        g_all = all_gather_rows(g.to(dtype), n, ctx.group)  # (n B, T/n, C) token-major
        x_mm = (to_token_major(x, n) if ctx.reorder_input else x).to(dtype)  # the forward's matmul input
        grad_w = (g_all.flatten(0, -2).t() @ x_mm.flatten(0, -2)).to(w.dtype)  # (C, K)
        del x_mm  # each transient is freed once used, in both backward functions: a lower high-water mark of the heap
        grad_b = None if ctx.b_dtype is None else g_all.sum(dim=tuple(range(g_all.ndim - 1))).to(ctx.b_dtype)
        grad_x = g_all @ w.to(dtype)  # (n B, T/n, K)
        del g_all
        if ctx.reorder_input:
            grad_x = to_sequence_order(grad_x, n)  # (B, T, K)
        return grad_x.to(ctx.x_dtype), grad_w, grad_b, None, None, None


class _ColParallel(torch.autograd.Function):
    """Column-parallel: all_gather(x) W^T + b, x this rank's (B, T/n, C) slice; backward gathers x again (Megatron-LM),
    overlapped with the matmuls. in_order: the gather in (B, T) order (attention, lm_head), else token-major (MLP)."""

    @staticmethod
    def forward(ctx, x, w, b, n: int, group: str, in_order: bool) -> torch.Tensor:
        xs = cast_for_matmul(x)  # (B, T/n, C) in the matmul's dtype
        xg = all_gather_rows(xs, n, group)  # (n B, T/n, C) token-major
        y = F.linear(to_sequence_order(xg, n) if in_order else xg, w, b)  # (B, T, H) or (n B, T/n, H)
        ctx.save_for_backward(xs, w)
        ctx.n, ctx.group, ctx.in_order, ctx.x_dtype = n, group, in_order, x.dtype
        ctx.b_dtype = None if b is None else b.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        xs, w = ctx.saved_tensors
        n, group = ctx.n, ctx.group
        gathering = _C10D.all_gather_into_tensor(xs.contiguous(), n, group)  # the input again, while grad_x runs
        grad_x = g @ w.to(g.dtype)  # (B, T, C) or (n B, T/n, C)
        if ctx.in_order:
            grad_x = to_token_major(grad_x, n)  # (B, T, C) -> (n B, T/n, C)
        scattering = _C10D.reduce_scatter_tensor(grad_x.contiguous(), "sum", n, group)  # while grad_w runs
        del grad_x
        xg = _C10D.wait_tensor(gathering)  # (n B, T/n, C)
        del gathering
        if ctx.in_order:
            xg = to_sequence_order(xg, n)  # (B, T, C)
        grad_w = (g.flatten(0, -2).t() @ xg.flatten(0, -2).to(g.dtype)).to(w.dtype)  # (H, C)
        grad_b = None if ctx.b_dtype is None else g.sum(dim=tuple(range(g.ndim - 1))).to(ctx.b_dtype)
        grad_xs = _C10D.wait_tensor(scattering)  # (B, T/n, C)
        return grad_xs.to(ctx.x_dtype), grad_w, grad_b, None, None, None


class ColwiseLinear(nn.Linear):
    """Column-parallel (Shard(0)); gather: None (input already whole), "in_order" or "token_major" (_ColParallel)."""

    tp: _TP
    gather: str | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather is None:
            return F.linear(x, self.weight.to_local(), _local(self.bias))
        return _ColParallel.apply(x, self.weight.to_local(), _local(self.bias), self.tp.n, self.tp.group,
                                  self.gather == "in_order")


class RowwiseLinear(nn.Linear):
    """Row-parallel (weight Shard(1), bias replicated), reduce-scattered to this rank's slice (_RowParallel)."""

    tp: _TP
    reorder_input: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RowParallel.apply(x, self.weight.to_local(), _local(self.bias), self.tp.n, self.tp.group,
                                  self.reorder_input)


class VocabParallelEmbedding(nn.Embedding):
    """wte split over the vocabulary (Shard(0)): token-major lookups of the ids held here (zeros elsewhere), summed
    over ranks by a reduce-scatter into this rank's (B, T/n, C) slice."""

    tp: _TP

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n, w = self.tp.n, self.weight.to_local()  # (V/n, C)
        local = to_token_major(idx, n) - self.tp.rank * w.shape[0]  # (B, T) -> (n B, T/n)
        outside = (local < 0) | (local >= w.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)  # (n B, T/n, C) partial
        return reduce_scatter_rows(y, n, self.tp.group)  # (B, T/n, C)


class VocabParallelHead(ColwiseLinear):
    """lm_head split over the vocabulary (Shard(0), tied to wte), gathering in (B, T) order: this rank's logits
    (B, T, V/n) as a Shard(-1) DTensor for gpt_tp.parallel.loss.cross_entropy."""

    gather = "in_order"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(super().forward(x), self.tp.mesh, (Shard(-1),), run_check=False)  # (B, T, V/n)


class LocalStyle(ParallelStyle):
    """Distribute a module's parameters on the TP mesh and swap in its local-tensor class (one of the above)."""

    def __init__(self, cls: type, placements: dict[str, list], **attrs):
        super().__init__()
        self.cls, self.placements, self.attrs = cls, placements, attrs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            p = getattr(module, name, None)
            if p is not None:
                param = nn.Parameter(distribute_tensor(p, device_mesh, placement), requires_grad=p.requires_grad)
                module.register_parameter(name, param)
        module.__class__ = self.cls
        vars(module).update(self.attrs, tp=_TP(device_mesh))  # plain values: no Module.__setattr__ needed
        return module


# TP_PLAN's styles: colwise(gather=...), rowwise(reorder_input=...), vocab_embedding(), vocab_head()
colwise = partial(LocalStyle, ColwiseLinear, {"weight": [Shard(0)], "bias": [Shard(0)]}, gather=None)
rowwise = partial(LocalStyle, RowwiseLinear, {"weight": [Shard(1)], "bias": [Replicate()]})
vocab_embedding = partial(LocalStyle, VocabParallelEmbedding, {"weight": [Shard(0)]})
vocab_head = partial(LocalStyle, VocabParallelHead, {"weight": [Shard(0)], "bias": [Shard(0)]})
