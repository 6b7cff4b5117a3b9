"""The tensor-parallel plan for gpt_tp.model.GPT, and how it is applied: TP -> activation checkpointing -> compile -> FSDP2.

Megatron-style tensor parallelism with sequence parallelism on the mesh's "tensor_parallel" dim:
between blocks the residual stream is split along the sequence (Shard(1), a plain local tensor of shape
(B, T/tp, C)); LayerNorms and dropouts run on that slice. Before attention and the MLP an all-gather makes the
full sequence (Shard(1) -> Replicate); q/k/v and c_fc are column-parallel (each rank holds whole heads / a
slice of the 4C hidden units), the output projections are row-parallel and reduce-scatter straight back to
Shard(1). The token embedding is vocab-parallel, lm_head is column-parallel over the vocabulary and feeds
the vocab-parallel cross-entropy of gpt_tp.loss, so full [B, T, vocab] logits never exist on one rank. Every parameter,
wpe and the LayerNorms included, becomes a DTensor on the mesh, which clip_grad_norm_ and fused AdamW need.

The model file knows nothing of this: `view(B, T, -1, ...)` in attention picks up n_head / tp heads.
"""

import warnings
from functools import partial
from math import gcd, prod

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

from gpt_tp.errors import UserError
from gpt_tp.model import GPT, GPTConfig


class LayoutError(UserError):
    """A model / device layout that cannot work; the message says what to change."""


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
    # head: all-gather the sequence, vocab-sharded logits stay a DTensor for gpt_tp.loss.cross_entropy
    "transformer.ln_f": SequenceReplicated(),
    "lm_head": VocabParallelHead(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp_sizes(config: GPTConfig, seq_len: int | None = None) -> list[int]:
    """TP degrees this model can be split over: each must divide the heads, the widths, the vocab and T."""
    g = gcd(config.n_head, config.n_embd, 4 * config.n_embd, config.vocab_size)
    if seq_len is not None:
        g = gcd(g, seq_len)
    return _divisors(g)


def fitting_layouts(config: GPTConfig, world_size: int, seq_len: int | None = None) -> list[tuple[int, int]]:
    """(dp, tp) pairs with dp * tp == world_size and a valid tp, smallest TP first."""
    return [(world_size // tp, tp) for tp in valid_tp_sizes(config, seq_len) if world_size % tp == 0]


def _layouts_text(config: GPTConfig, world_size: int, seq_len: int | None) -> str:
    fits = fitting_layouts(config, world_size, seq_len)
    s = ", ".join(f"DP={dp} x TP={tp}" for dp, tp in fits)
    return f"Layouts that fit {world_size} devices: {s}." if fits else f"No DP x TP layout fits {world_size} devices."


def validate_layout(
    config: GPTConfig, tp: int, dp: int = 1, world_size: int | None = None, seq_len: int | None = None
) -> None:
    """Raise LayoutError naming the flag to change if this model cannot run as dp x tp on world_size devices."""
    world_size = dp * tp if world_size is None else world_size
    if tp < 1 or dp < 1:
        raise LayoutError(f"tensor_parallel_size={tp} and data_parallel_size={dp} must be >= 1")
    if dp * tp != world_size:
        raise LayoutError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp}, but the run has {world_size} devices "
            f"(trainer.devices x trainer.num_nodes). {_layouts_text(config, world_size, seq_len)}"
        )
    checks = [
        ("model.n_head", config.n_head, "every rank holds whole attention heads"),
        ("model.n_embd", config.n_embd, "row-parallel projections split the width"),
        ("4 * model.n_embd", 4 * config.n_embd, "the MLP's hidden units are split"),
        ("model.vocab_size", config.vocab_size, "the embedding and lm_head are split over the vocabulary; pad it"),
    ]
    if seq_len is not None:
        checks.append(("the sequence length (data.seq_len)", seq_len, "sequence parallelism splits T"))
    for name, value, why in checks:
        if value % tp:
            raise LayoutError(
                f"tensor_parallel_size={tp} must divide {name}={value} ({why}); it divides by "
                f"{', '.join(map(str, _divisors(value)[:12]))}. Valid TP sizes for this model: "
                f"{', '.join(map(str, valid_tp_sizes(config, seq_len)))}. {_layouts_text(config, world_size, seq_len)}"
            )


def data_parallel_rank_size(trainer) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel replicas: the DP dim of ModelParallelStrategy's mesh,
    all processes for DDP-like strategies, (0, 1) without a trainer or on one device."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
    kwargs = kwargs or {}
    return kwargs.get("rank", 0), kwargs.get("num_replicas", 1)


def is_parallelized(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


AC_MODES = ("none", "full", "selective")

# selective activation checkpointing keeps the outputs of these ops (the matmuls and attention, whose recomputation
# costs the FLOPs) and recomputes everything else in the block (LayerNorms, GELU, adds, casts, TP collectives)
_AC_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _AC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def check_ac_mode(mode: str) -> None:
    if mode not in AC_MODES:
        raise UserError(f"model.activation_checkpointing={mode!r}: use one of {', '.join(AC_MODES)}")


def apply_ac(model: GPT, mode: str) -> None:
    """Activation checkpointing per block (torch.utils.checkpoint, non-reentrant). "full": a block keeps only its
    input and reruns its whole forward in backward; "selective": a block keeps its matmul and attention outputs
    and reruns the rest; "none": nothing changes. Each block checkpoints itself (Block.checkpoint_activations), so
    parameter names (checkpoints, exports) are the same in every mode."""
    check_ac_mode(mode)
    if mode == "none":
        return
    context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) if mode == "selective" else noop_context_fn
    for block in model.transformer.h:
        block.checkpoint_activations(context_fn)


def parallelize(
    model: GPT, mesh: DeviceMesh | None, compile: bool = False, param_dtype: torch.dtype | None = None,
    activation_checkpointing: str = "none",
) -> GPT:
    """Apply TP (on mesh["tensor_parallel"]), then activation checkpointing per block, then torch.compile per block,
    then FSDP2 (on mesh["data_parallel"]).

    The fixed order matters: checkpointing wraps the TP-annotated blocks, so recomputation replays their
    collectives; compile must see the TP-annotated (and checkpointed) blocks; FSDP2 wraps the compiled blocks,
    gathers a block's weights again before its backward (and so before its recomputation), and composes with the
    TP DTensors into one 2-D (dp, tp) mesh. mesh=None (one device) only checkpoints and compiles.
    param_dtype (bf16 for bf16-mixed): FSDP2 all-gathers parameters in it and reduce-scatters gradients in float32.
    Idempotent: an already-parallelized model is left as is.
    """
    if is_parallelized(model):
        return model
    tp_size = mesh["tensor_parallel"].size() if mesh is not None else 1
    dp_size = mesh["data_parallel"].size() if mesh is not None else 1
    validate_layout(model.config, tp=tp_size, dp=dp_size)

    # 1. Tensor parallelism. parallelize_module registers new Parameters, which unties wte and lm_head:
    #    both are Shard(0) over the vocabulary, so the tie is restored by pointing lm_head at wte's new DTensor.
    if tp_size > 1:
        tp_mesh = mesh["tensor_parallel"]
        parallelize_module(model, tp_mesh, TP_PLAN)
        model.tie_weights()

    # 2. Activation checkpointing, each block's forward wrapped in place (apply_ac).
    apply_ac(model, activation_checkpointing)

    # 3. torch.compile each block in place (keeps parameter names free of _orig_mod).
    if compile:
        for block in model.transformer.h:
            block.compile()

    # 4. FSDP2 over the data-parallel dim: each block is a unit, the root takes embeddings, ln_f and lm_head.
    if dp_size > 1:
        dp_mesh = mesh["data_parallel"]
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
        for block in model.transformer.h:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model


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


@torch.no_grad()
def reduce_partial_grads(model: nn.Module) -> int:
    """Sum the sequence-partial gradients (LayerNorms, wpe: see SequenceReplicated) over the TP group, all of them
    in one flat all-reduce, in place. Call it once per optimizer step, after the (accumulated) backward and, at
    DP > 1, after FSDP2's reduce-scatter, so each rank sums only its DP shard; clip_grad_norm calls it (a second
    call would add the sums again). Returns the number of gradients reduced."""
    grads = [p.grad.to_local() for m in model.modules() if is_sequence_partial(m)
             for p in m.parameters(recurse=False) if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        mesh = next(p for m in model.modules() if is_sequence_partial(m) for p in m.parameters(recurse=False)).device_mesh
        dist.all_reduce(flat, group=mesh.get_group("tensor_parallel"))
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
    return len(grads)


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """This rank's share of the squared global norm: the local shards' squares, each divided by how many ranks
    hold a copy of it (the product of the mesh dims it is replicated on), so summing over all ranks counts every
    element once."""
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        copies = 1
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError(f"a gradient is still Partial ({g.placements}): the plan left a reduction undone")
            copies = prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
            g = g.to_local()
        by_copies.setdefault(copies, []).append(g)
    squares = [torch.nn.utils.get_total_norm(gs, foreach=True).float() ** 2 / c for c, gs in by_copies.items()]
    return torch.stack(squares).sum() if squares else torch.zeros(())


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """The step's gradient sync and clipping, for every layout: sum the sequence-partial gradients over TP
    (reduce_partial_grads), take the global norm with one all-reduce of the squared-norm shares over the whole
    (dp, tp) mesh, and scale the gradients down to max_norm if it is set. Returns the norm before clipping as a
    plain scalar tensor, without a host sync."""
    reduce_partial_grads(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = _sum_of_squares(grads)
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    if meshes:
        (mesh,) = meshes  # every parameter lives on the one (dp, tp) mesh
        if mesh.ndim > 1 and mesh.size() != dist.get_world_size():
            raise RuntimeError(f"the grad norm reduces over the whole job, but the mesh {mesh} does not span it")
        dist.all_reduce(sq, group=mesh.get_group() if mesh.ndim == 1 else None)
    norm = sq.sqrt()
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm, foreach=True)
    return norm


def _fill_local_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's shard of the full tensor into a (possibly) DTensor parameter, without communication."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def materialize(model: GPT, device: torch.device) -> None:
    """After building on the meta device and parallelizing: allocate the local shards and give them GPT-2's init
    (not PyTorch's reset_parameters): the same numbers as the single-device init, since each parameter is drawn
    at full size from the model's init_seed and cut to the local shard. In a process group the seed is rank 0's,
    broadcast to every rank, so ranks whose random state differs still cut their shards from one init. Nothing
    happens if no parameter is meta."""
    if not any(p.is_meta for p in model.parameters()):
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        seed = torch.tensor([model.init_seed], dtype=torch.int64, device=device)
        torch.distributed.broadcast(seed, src=0)
        model.init_seed = int(seed.item())
    model.to_empty(device=device)
    model.init_weights(fill=_fill_local_shard)
