"""The MLP with its sequence-parallel collectives overlapped with its matmuls (model.tp_overlap_chunks > 1).

Each rank's tokens (B T/n of them) are cut into k chunks. Forward: the all-gathers of all k chunks are started at
once (async collectives on the TP process group; gloo and NCCL run them beside the compute), chunk j's
c_fc -> GELU -> c_proj runs as soon as its gather is in, and its partial sums start their reduce-scatter while
chunk j+1 computes. Backward mirrors it: the output gradient's chunks are all-gathered ahead, and each chunk's
input-gradient reduce-scatter runs while the next chunk's matmuls do. The MLP is token-wise, so every token
gets the same arithmetic as in one piece; the weight gradients are summed chunk by chunk.

The collectives stay 2 all-gathers and 2 reduce-scatters per MLP per step in bytes, but k of each in count.
Eager only: the async handles are not traceable by torch.compile.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from gpt_tp.model import MLP
from gpt_tp.parallel.sp import autocast_dtype_of


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
        dtype = autocast_dtype_of(x)
        if dtype is not None:  # run the chunks in the autocast dtype, as the matmuls would
            x, params = x.to(dtype), [p.to(dtype) for p in params]
        with torch.autocast(x.device.type, enabled=False):
            y = _ChunkedMLP.apply(x.reshape(B * t, C), *params, self.chunks, self.group)  # (B t, C)
        return self.dropout(y.view(B, t, C))  # (B, T/n, C)


class OverlappedMLP(ParallelStyle):
    """Plan entry for "transformer.h.*.mlp" with model.tp_overlap_chunks = k > 1 (see the module docstring)."""

    def __init__(self, chunks: int):
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.__class__ = ChunkedMLPForward
        module.chunks, module.group = self.chunks, device_mesh.get_group()
        return module
