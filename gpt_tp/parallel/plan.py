"""The tensor-parallel plan for gpt_tp.model.GPT, and how it is applied: TP -> activation checkpointing -> compile -> FSDP2.

Megatron-style tensor parallelism with sequence parallelism on the mesh's "tensor_parallel" dim:
between blocks the residual stream is split along the sequence (Shard(1), a plain local tensor of shape
(B, T/tp, C)); LayerNorms and dropouts run on that slice. Before attention and the MLP an all-gather makes the
full sequence (Shard(1) -> Replicate); q/k/v and c_fc are column-parallel (each rank holds whole heads / a
slice of the 4C hidden units), the output projections are row-parallel and reduce-scatter straight back to
Shard(1). The token embedding is vocab-parallel, lm_head is column-parallel over the vocabulary and feeds
the vocab-parallel cross-entropy of gpt_tp.parallel.loss, so full [B, T, vocab] logits never exist on one rank. Every parameter,
wpe and the LayerNorms included, becomes a DTensor on the mesh, which clip_grad_norm_ and fused AdamW need.

The model file knows nothing of this: `view(B, T, -1, ...)` in attention picks up n_head / tp heads.
"""

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)



class _LocalLayerNorm(nn.LayerNorm):
    """LayerNorm on this rank's sequence slice (B, T/tp, C), with the local copy of its replicated weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to_local(), self.bias.to_local(), self.eps)


class _LocalEmbedding(nn.Embedding):
    """wpe: looks up this rank's positions (T/tp,) in the local copy of its replicated weight."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight.to_local())


_LOCAL = {nn.LayerNorm: _LocalLayerNorm, nn.Embedding: _LocalEmbedding}


class SequenceReplicated(ParallelStyle):
    """LayerNorms and wpe under sequence parallelism, Megatron's way: weights replicated DTensors on the TP mesh,
    computed on this rank's slice of the sequence with their local copies (no communication in forward).

    `to_local()` hands each weight gradient back labelled Replicate while it holds only this rank's slice's
    contribution (a sum over T/tp positions). So FSDP2 at DP > 1 reduce-scatters it over DP like any other
    gradient, with no all-reduce of its own per parameter, and reduce_partial_grads then sums all of these
    gradients over TP in one all-reduce. split_input: cut the module's input (wpe's positions, (T,) on every rank)
    to this rank's T/tp along dim 0; the other modules already receive the (B, T/tp, C) local slice."""

    def __init__(self, split_input: bool = False):
        super().__init__()
        self.split_input = split_input

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, device_mesh, [Replicate()])))
        module.__class__ = _LOCAL[type(module)]
        if self.split_input:
            n, r = device_mesh.size(), device_mesh.get_local_rank()
            module.register_forward_pre_hook(lambda mod, args: tuple(a.chunk(n)[r] for a in args))
        return module


def is_sequence_partial(module: nn.Module) -> bool:
    """A module whose weight gradients are per-rank partial sums over the TP group (SequenceReplicated)."""
    return isinstance(module, tuple(_LOCAL.values()))


def _cast_to_autocast_dtype(module: nn.Module, args: tuple) -> tuple | None:
    """Under autocast, LayerNorm outputs float32 but the matmul after it runs in bf16: cast before the all-gather,
    so the gather (and its backward reduce-scatter) moves 2-byte elements. Same forward numbers."""
    device = args[0].device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


class _GatherInAutocastDtype:
    """Mixin for styles whose input is all-gathered: register the cast above ahead of the style's own hooks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_pre_hook(_cast_to_autocast_dtype, prepend=True)
        return module


class GatherInput(_GatherInAutocastDtype, PrepareModuleInput):
    """PrepareModuleInput (Shard(1) -> Replicate all-gather) in the autocast dtype."""


class VocabParallelHead(_GatherInAutocastDtype, ColwiseParallel):
    """ColwiseParallel lm_head whose sequence all-gather runs in the autocast dtype."""


# The plan, keyed by module path. Order within the dict does not matter: each entry parallelizes its own module.
TP_PLAN: dict[str, ParallelStyle] = {
    # token ids (replicated) -> vocab-parallel lookup -> reduce-scatter to the sequence-sharded residual stream
    "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "transformer.wpe": SequenceReplicated(split_input=True),
    "transformer.drop": SequenceParallel(use_local_output=True),
    # attention: LayerNorm on the sequence slice, all-gather, whole heads per rank, reduce-scatter back
    "transformer.h.*.ln_1": SequenceReplicated(),
    "transformer.h.*.attn": GatherInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "transformer.h.*.attn.c_attn": ColwiseParallel(),
    "transformer.h.*.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    "transformer.h.*.attn.resid_dropout": SequenceParallel(use_local_output=True),
    # MLP: the same pattern, the 4C hidden units split over ranks
    "transformer.h.*.ln_2": SequenceReplicated(),
    "transformer.h.*.mlp": GatherInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "transformer.h.*.mlp.c_fc": ColwiseParallel(),
    "transformer.h.*.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    "transformer.h.*.mlp.dropout": SequenceParallel(use_local_output=True),
    # head: all-gather the sequence, vocab-sharded logits stay a DTensor for gpt_tp.parallel.loss.cross_entropy
    "transformer.ln_f": SequenceReplicated(),
    "lm_head": VocabParallelHead(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
}


def enable_async_tp(tp_mesh) -> None:
    """Turn on asynchronous tensor parallelism for compiled blocks: Inductor's micro-pipelining pass
    (torch._inductor.config._micro_pipeline_tp) fuses each all-gather with the matmul that consumes it, and each
    matmul with the reduce-scatter after it, over symmetric memory on the TP group. Call before the first
    compiled forward. Needs CUDA devices and torch.compile; refused elsewhere with the reason."""
    if tp_mesh.device_type != "cuda":
        raise RuntimeError(
            f"async TP needs CUDA GPUs (symmetric memory over NVLink); this TP mesh is on '{tp_mesh.device_type}'. "
            "Leave async TP off on CPU."
        )
    if tp_mesh.size() < 2:
        raise RuntimeError("async TP needs tensor_parallel_size >= 2: there is nothing to overlap at TP=1")
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory  # no public API for this yet (torchtitan does the same)

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # deprecated in recent torch, but the Inductor pass still checks for it
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(tp_mesh.get_group().group_name)
