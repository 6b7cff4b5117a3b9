"""The gradient sync over TP (once per optimizer step, after the last backward) and the global norm, clipped."""

from math import prod

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from gpt_tp.parallel.plan import SEQUENCE_PARTIAL


@torch.no_grad()
def sync_grads(model: nn.Module) -> None:
    """The step's gradient sync: sum the sequence-partial gradients (SequenceReplicated: LayerNorms, wpe) over TP in
    one flat all-reduce, in place. Run once per optimizer step, right after the last micro-batch's backward (and, at
    DP > 1, FSDP2's reduce-scatter, so each rank sums only its DP shard): from then on every gradient is the model's
    true one, as its Replicate placement says. A second run would add the sums again."""
    params = [p for m in model.modules() if isinstance(m, SEQUENCE_PARTIAL) for p in m.parameters(recurse=False)]
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=params[0].device_mesh.get_group("tensor_parallel"))
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def grad_norm(model: nn.Module, carry: torch.Tensor | None = None) -> torch.Tensor:
    """The global gradient norm of synced gradients (sync_grads), for every layout: one all-reduce over the whole job
    of the squared-norm shares, which also sums `carry` (float32 values, in place: the step's loss and flags). Pure:
    reads the gradients only. A plain scalar tensor, no host sync."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    # each local shard's squares over how many ranks hold a copy (a plain tensor: all; a DTensor: its replicated dims)
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        copies = world
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError(f"a gradient is still Partial ({g.placements}): the plan left a reduction undone")
            if g.device_mesh.size() != world:
                raise RuntimeError(f"the grad norm reduces over the whole job, but the mesh {g.device_mesh} does not span it")
            copies = prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
            g = g.to_local()
        by_copies.setdefault(copies, []).append(g)
    squares = [torch.nn.utils.get_total_norm(gs, foreach=True).float() ** 2 / c for c, gs in by_copies.items()]
    sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if world > 1:
        flat = torch.cat([sq.reshape(1), *([] if carry is None else [carry])])
        dist.all_reduce(flat)
        sq = flat[0]
        if carry is not None:
            carry.copy_(flat[1:])
    return sq.sqrt()


def clip_grad_norm(model: nn.Module, max_norm: float | None, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Scale the synced gradients down to max_norm (if set) by their global norm (`norm`, or taken here); returns it."""
    norm = grad_norm(model) if norm is None else norm
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm, foreach=True)
    return norm
