"""The tensor-parallel plan for gpt_tp.model.GPT (TP_PLAN), and the reference plans it is measured against.

Megatron-style tensor parallelism with sequence parallelism on the mesh's "tensor_parallel" dim:
between blocks the residual stream is split along the sequence (a plain local tensor of shape (B, T/tp, C));
LayerNorms and dropouts run on that slice. Before attention and the MLP an all-gather makes the full sequence;
q/k/v and c_fc are column-parallel (each rank holds whole heads / a slice of the 4C hidden units), the output
projections are row-parallel and reduce-scatter straight back to the slice. The token embedding is
vocab-parallel, lm_head is column-parallel over the vocabulary and feeds the vocab-parallel cross-entropy of
gpt_tp.parallel.loss, so full [B, T, vocab] logits never exist on one rank. Every parameter, wpe and the
LayerNorms included, is a DTensor on the mesh, which clip_grad_norm and fused AdamW need; the blocks compute on
the local shards with explicit collectives (gpt_tp.parallel.sp).

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

from gpt_tp.errors import UserError
from gpt_tp.parallel.overlap import OverlappedMLP
from gpt_tp.parallel.sp import cast_for_matmul, colwise, rowwise, vocab_embedding, vocab_head


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


def sequence_parallel_plan(token_major: bool = True, overlap_chunks: int = 1) -> dict[str, ParallelStyle]:
    """gpt_tp's plan on local tensors (gpt_tp.parallel.sp), keyed by module path. token_major=False gathers every
    activation in (B, T) order and rearranges every partial sum before its reduce-scatter (a copy each, as DTensor
    does); overlap_chunks > 1 runs each MLP as k chunks with its collectives overlapped (gpt_tp.parallel.overlap)."""
    plan = {
        # token ids (replicated) -> vocab-parallel lookup -> reduce-scatter to the sequence-sharded residual stream
        "transformer.wte": vocab_embedding(token_major),
        "transformer.wpe": SequenceReplicated(split_input=True),
        # attention: LayerNorm on the sequence slice, c_attn all-gathers it in (B, T) order, whole heads per rank,
        # c_proj reduce-scatters
        "transformer.h.*.ln_1": SequenceReplicated(),
        "transformer.h.*.attn.c_attn": colwise(gather="in_order"),
        "transformer.h.*.attn.c_proj": rowwise("input" if token_major else "output"),
        # MLP: the same pattern, the 4C hidden units split over ranks, on the token-major gathered buffer
        "transformer.h.*.ln_2": SequenceReplicated(),
        "transformer.h.*.mlp.c_fc": colwise(gather="token_major" if token_major else "in_order"),
        "transformer.h.*.mlp.c_proj": rowwise(None if token_major else "output"),
        # head: all-gather the sequence, vocab-sharded logits as a DTensor for gpt_tp.parallel.loss.cross_entropy
        "transformer.ln_f": SequenceReplicated(),
        "lm_head": vocab_head(),
    }
    if overlap_chunks > 1:
        plan["transformer.h.*.mlp"] = OverlappedMLP(overlap_chunks)  # gathers itself: c_fc takes the gathered input
        plan["transformer.h.*.mlp.c_fc"] = colwise()
    return plan


# The plan, keyed by module path. Order within the dict does not matter: each entry parallelizes its own module.
TP_PLAN: dict[str, ParallelStyle] = sequence_parallel_plan()


def dtensor_plan(torch_recipe: bool = False) -> dict[str, ParallelStyle]:
    """The same layout with torch's DTensor styles (every block op dispatched on DTensors; gathers and scatters
    along T rearrange their buffers). torch_recipe: the plain torch recipe, LayerNorms and dropouts as
    SequenceParallel, so their weight gradients are reduced per parameter by DTensor in backward (train it with
    torch's loss_parallel; see gpt_tp.train.module). Dropouts run on the local slices, as in gpt_tp's plan."""
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


# model.tp_plan: gpt_tp's plan and the references it is measured against (gpt_tp.perf.scaling)
PLANS = {
    "gpt_tp": lambda chunks: sequence_parallel_plan(True, chunks),
    "gpt_tp_ordered": lambda chunks: sequence_parallel_plan(False, chunks),
    "dtensor": lambda chunks: dtensor_plan(),
    "torch": lambda chunks: dtensor_plan(torch_recipe=True),
}


def check_plan(name: str, overlap_chunks: int = 1) -> None:
    """model.tp_plan names one of PLANS; model.tp_overlap_chunks >= 1, above 1 only with a gpt_tp plan."""
    if name not in PLANS:
        raise UserError(f"model.tp_plan={name!r}: use one of {', '.join(PLANS)}")
    if overlap_chunks < 1:
        raise UserError(f"model.tp_overlap_chunks={overlap_chunks} must be >= 1 (1: no overlap)")
    if overlap_chunks > 1 and not name.startswith("gpt_tp"):
        raise UserError(f"model.tp_overlap_chunks={overlap_chunks} needs model.tp_plan gpt_tp or gpt_tp_ordered, not {name!r}")


def make_plan(name: str = "gpt_tp", overlap_chunks: int = 1) -> dict[str, ParallelStyle]:
    """A plan by name (PLANS); overlap_chunks applies to the gpt_tp plans only."""
    check_plan(name, overlap_chunks)
    return PLANS[name](overlap_chunks)


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
