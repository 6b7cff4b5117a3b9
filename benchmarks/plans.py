"""Reference tensor-parallel plans that gpt_tp's TP_PLAN is measured against, and the MLP with its collectives
overlapped. They sit beside the package: the product trains with TP_PLAN only. Each plan is a dict of module
path -> ParallelStyle, loaded by `--plan benchmarks.plans:<name>`, the door a user's own plan goes through
(python -m benchmarks.paritycheck --plan, benchmarks/fit.py --plan, tests/workers/parity.py --plan):

    ordered       gpt_tp's layout with every activation gathered in (B, T) order and every partial sum rearranged
                  before its reduce-scatter (a copy each, as DTensor does): what token-major order saves
    dtensor       the same layout with torch's DTensor styles (every block op dispatched on DTensors)
    torch_recipe  the plain torch recipe: LayerNorms as torch's SequenceParallel, so their gradients are left
                  Partial and reduced per parameter (reduce_dtensor_partial_grads); benchmarks.fit:TorchRecipe
                  trains it through cli.py with torch's loss_parallel
    overlap2, overlap3  gpt_tp's plan with each MLP in k chunks whose all-gathers and reduce-scatters overlap its
                  matmuls (OverlappedMLP; eager only)

The overlapped MLP: each rank's tokens (B T/n of them) are cut into k chunks. Forward: the all-gathers of all k
chunks are started at once (async collectives on the TP process group; gloo and NCCL run them beside the compute),
chunk j's c_fc -> GELU -> c_proj runs as soon as its gather is in, and its partial sums start their reduce-scatter
while chunk j+1 computes. Backward mirrors it. The MLP is token-wise, so every token gets the same arithmetic as in
one piece; the weight gradients are summed chunk by chunk. The collectives keep their bytes but are k of each in
count. Eager only: the async handles are not traceable by torch.compile.
"""

from importlib import import_module

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from gpt_tp.errors import UserError
from gpt_tp.model import MLP
from gpt_tp.parallel import TP_PLAN, SequenceReplicated
from gpt_tp.parallel.sp import (
    LocalStyle, RowwiseLinear, VocabParallelEmbedding, _local, all_gather_rows, cast_for_matmul,
    colwise, reduce_scatter_rows, to_sequence_order, to_token_major,
)


def import_attribute(spec: str, flag: str, example: str):
    """`module:attribute` (a flag's value) -> the object; a UserError naming the flag when it cannot be had."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise UserError(f"{flag}={spec!r} must be module:attribute, e.g. {example}")
    try:
        mod = import_module(mod_name)
    except ImportError as e:
        raise UserError(f"{flag}={spec!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    if not hasattr(mod, attr):
        raise UserError(f"{flag}={spec!r}: module {mod_name!r} has no attribute {attr!r}")
    return getattr(mod, attr)


# ---- ordered: gpt_tp's layout, every activation in (B, T) order -------------------------------------------------
class OrderedEmbedding(VocabParallelEmbedding):
    """The vocab-parallel lookup on the ids in (B, T) order, its (B, T, C) partial sums rearranged to token-major
    before the reduce-scatter (a copy of activations, where gpt_tp's copies the integer ids)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n, w = self.tp.n, self.weight.to_local()  # (V/n, C)
        local = idx - self.tp.rank * w.shape[0]
        outside = (local < 0) | (local >= w.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C) partial
        return reduce_scatter_rows(to_token_major(y, n), n, self.tp.group)  # (B, T/n, C)


class _OrderedRowParallel(torch.autograd.Function):
    """y = x W^T on x (B, T, K) in order, the (B, T, C) partial sums rearranged to token-major, reduce-scattered to
    this rank's (B, T/n, C) slice, plus the replicated bias (its gradient summed over all tokens, as gpt_tp's)."""

    @staticmethod
    def forward(ctx, x, w, b, n: int, group: str) -> torch.Tensor:
        y = to_token_major(F.linear(x, w), n)  # (B, T, C) -> (n B, T/n, C)
        out = reduce_scatter_rows(y, n, group)  # (B, T/n, C)
        if b is not None:
            out.add_(b.to(out.dtype))
        ctx.save_for_backward(x, w)
        ctx.n, ctx.group, ctx.dtype, ctx.x_dtype = n, group, y.dtype, x.dtype
        ctx.b_dtype = None if b is None else b.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        g_all = to_sequence_order(all_gather_rows(g.to(ctx.dtype), ctx.n, ctx.group), ctx.n)  # (B, T, C)
        grad_w = (g_all.flatten(0, -2).t() @ x.to(ctx.dtype).flatten(0, -2)).to(w.dtype)  # (C, K)
        grad_b = None if ctx.b_dtype is None else g_all.sum(dim=tuple(range(g_all.ndim - 1))).to(ctx.b_dtype)
        grad_x = g_all @ w.to(ctx.dtype)  # (B, T, K)
        return grad_x.to(ctx.x_dtype), grad_w, grad_b, None, None


class OrderedRowwiseLinear(RowwiseLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OrderedRowParallel.apply(x, self.weight.to_local(), _local(self.bias), self.tp.n, self.tp.group)


ordered = {
    **TP_PLAN,
    "transformer.wte": LocalStyle(OrderedEmbedding, {"weight": [Shard(0)]}),
    "transformer.h.*.attn.c_proj": LocalStyle(OrderedRowwiseLinear, {"weight": [Shard(1)], "bias": [Replicate()]}),
    "transformer.h.*.mlp.c_fc": colwise(gather="in_order"),
    "transformer.h.*.mlp.c_proj": LocalStyle(OrderedRowwiseLinear, {"weight": [Shard(1)], "bias": [Replicate()]}),
}


# ---- dtensor and torch_recipe: torch's own styles -------------------------------------------------------------
def _cast_to_autocast_dtype(module: nn.Module, args: tuple) -> tuple | None:
    """A forward pre-hook: the inputs in the autocast dtype before the style's own all-gather (see cast_for_matmul)."""
    return tuple(cast_for_matmul(a) if torch.is_tensor(a) else a for a in args)


class _GatherInAutocastDtype:
    """Mixin for DTensor styles whose input is all-gathered: register the cast ahead of the style's own hooks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_pre_hook(_cast_to_autocast_dtype, prepend=True)
        return module


class _DTensorGatherInput(_GatherInAutocastDtype, PrepareModuleInput):
    """PrepareModuleInput (Shard(1) -> Replicate all-gather) in the autocast dtype."""


class _DTensorVocabHead(_GatherInAutocastDtype, ColwiseParallel):
    """ColwiseParallel lm_head whose sequence all-gather runs in the autocast dtype."""


def dtensor_plan(torch_recipe: bool = False) -> dict[str, ParallelStyle]:
    """gpt_tp's layout with torch's DTensor styles (gathers and scatters along T rearrange their buffers).
    torch_recipe: LayerNorms as torch's SequenceParallel, their weight gradients left Partial by DTensor.
    Dropouts run on the local slices, as in gpt_tp's plan."""
    norm = SequenceParallel if torch_recipe else SequenceReplicated
    return {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "transformer.wpe": SequenceReplicated(split_input=True),
        "transformer.h.*.ln_1": norm(),
        "transformer.h.*.attn": _DTensorGatherInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "transformer.h.*.attn.c_attn": ColwiseParallel(),
        "transformer.h.*.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "transformer.h.*.ln_2": norm(),
        "transformer.h.*.mlp": _DTensorGatherInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "transformer.ln_f": norm(),
        "lm_head": _DTensorVocabHead(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


dtensor = dtensor_plan()
torch_recipe = dtensor_plan(torch_recipe=True)


@torch.no_grad()
def reduce_dtensor_partial_grads(model: nn.Module) -> int:
    """Gradients DTensor left Partial (torch_recipe's LayerNorms) reduced one parameter at a time, an all-reduce
    each, before gpt_tp.parallel.clip_grad_norm (which refuses Partial gradients). Returns how many."""
    n = 0
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            n += 1
    return n


# ---- overlap: the MLP in k chunks -----------------------------------------------------------------------------
def _gather_async(x: torch.Tensor, group) -> tuple[torch.Tensor, dist.Work]:
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    return out, dist.all_gather_into_tensor(out, x, group=group, async_op=True)


def _reduce_scatter_async(x: torch.Tensor, group) -> tuple[torch.Tensor, dist.Work]:
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
    return out, dist.reduce_scatter_tensor(out, x, group=group, async_op=True)


class _ChunkedMLP(torch.autograd.Function):
    """x (M, C), this rank's tokens -> (M, C): reduce_scatter(c_proj(gelu(c_fc(all_gather(x))))) in k chunks.
    w1 (H, C), b1 (H,): c_fc's local rows; w2 (C, H): c_proj's local columns; b2 (C,) replicated, added to the
    reduce-scattered output; its gradient is the gathered output gradient summed over all tokens, on every rank."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, chunks: int, group):
        xs = x.contiguous().chunk(chunks)  # rows: (m, C) each
        gathers = [_gather_async(xc, group) for xc in xs]  # all in flight at once
        outs, pending, saved = [], [], []
        for xg, work in gathers:
            work.wait()  # xg: (n m, C), every rank's chunk j
            a = torch.addmm(b1, xg, w1.t())  # (n m, H)
            h = F.gelu(a, approximate="tanh")
            p = h @ w2.t()  # (n m, C) partial sums
            out, work = _reduce_scatter_async(p, group)
            outs.append(out)
            pending.append((work, p))  # p stays alive until its reduce-scatter is done
            saved += [xg, a, h]
        for work, _ in pending:
            work.wait()
        ctx.save_for_backward(w1, w2, *saved)
        ctx.chunks, ctx.group, ctx.has_b2 = chunks, group, b2 is not None
        y = torch.cat(outs)  # (M, C)
        return y if b2 is None else y + b2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        w1, w2, *saved = ctx.saved_tensors
        group = ctx.group
        gathers = [_gather_async(g, group) for g in grad.contiguous().chunk(ctx.chunks)]  # all in flight at once
        dw1, db1 = torch.zeros_like(w1), torch.zeros(w1.shape[0], dtype=w1.dtype, device=w1.device)
        dw2, db2 = torch.zeros_like(w2), torch.zeros(w2.shape[0], dtype=w2.dtype, device=w2.device)
        dxs, pending = [], []
        for j, (gp, work) in enumerate(gathers):
            xg, a, h = saved[3 * j : 3 * j + 3]
            work.wait()  # gp: (n m, C), the full output gradient of chunk j
            dw2.addmm_(gp.t(), h)  # (C, H)
            db2 += gp.sum(0)
            da = torch.ops.aten.gelu_backward(gp @ w2, a, approximate="tanh")  # (n m, H)
            dw1.addmm_(da.t(), xg)  # (H, C)
            db1 += da.sum(0)
            dx, work = _reduce_scatter_async(da @ w1, group)  # (n m, C) -> (m, C)
            dxs.append(dx)
            pending.append((work, da))
        for work, _ in pending:
            work.wait()
        return torch.cat(dxs), dw1, db1, dw2, db2 if ctx.has_b2 else None, None, None


class ChunkedMLPForward(MLP):
    """The MLP of a TP-parallelized block (c_fc, c_proj already local styles) running _ChunkedMLP on its
    sequence slice (B, T/n, C)."""

    chunks: int
    group: object

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, t, C = x.shape
        params = [self.c_fc.weight.to_local(), self.c_fc.bias.to_local(), self.c_proj.weight.to_local(),
                  self.c_proj.bias.to_local()]
        if torch.is_autocast_enabled(x.device.type):  # run the chunks in the autocast dtype, as the matmuls would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, params = x.to(dtype), [p.to(dtype) for p in params]
        with torch.autocast(x.device.type, enabled=False):
            y = _ChunkedMLP.apply(x.reshape(B * t, C), *params, self.chunks, self.group)  # (B t, C)
        return self.dropout(y.view(B, t, C))  # (B, T/n, C)


class OverlappedMLP(ParallelStyle):
    """Plan entry for "transformer.h.*.mlp": the MLP in k chunks (see the module docstring); c_fc then takes the
    gathered chunk as its input (colwise() without a gather of its own)."""

    def __init__(self, chunks: int):
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.__class__ = ChunkedMLPForward
        module.chunks, module.group = self.chunks, device_mesh.get_group()
        return module


def overlap_plan(chunks: int) -> dict[str, ParallelStyle]:
    return {**TP_PLAN, "transformer.h.*.mlp": OverlappedMLP(chunks), "transformer.h.*.mlp.c_fc": colwise()}


overlap2 = overlap_plan(2)
overlap3 = overlap_plan(3)

