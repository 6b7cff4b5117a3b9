"""Applying the plan in a fixed order: TP -> activation checkpointing -> compile -> FSDP2, then the init."""

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from gpt_tp.errors import UserError
from gpt_tp.model import GPT
from gpt_tp.parallel.plan import TP_PLAN
from gpt_tp.ranks import layout_of
from gpt_tp.sizing import AC_MODES, validate_layout


def is_parallelized(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


# selective activation checkpointing keeps the outputs of the matmuls and attention (whose recomputation costs the
# FLOPs) and recomputes everything else in the block (LayerNorms, GELU, adds, casts, TP collectives)
_AC_SAVE = {getattr(torch.ops.aten, op).default for op in (
    "mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")}


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _AC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def check_ac_mode(mode: str) -> None:
    if mode not in AC_MODES:
        raise UserError(f"model.activation_checkpointing={mode!r}: use one of {', '.join(AC_MODES)}")


def check_compiled_ac(mode: str, compile: bool, tp: int) -> None:
    """Full checkpointing of compiled blocks fails inside torch 2.13 at TP > 1 (its compiled checkpoint keeps the
    DTensor parameters' DeviceMesh among the saved tensors): refused with the alternatives."""
    if compile and mode == "full" and tp > 1:
        raise UserError("model.activation_checkpointing=full does not compile at tensor-parallel size > 1: use "
                        "model.activation_checkpointing=selective, or model.compile=false")


def apply_ac(model: GPT, mode: str) -> None:
    """Activation checkpointing per block: "full", "selective" or "none"."""
    check_ac_mode(mode)
    if mode == "none":
        return
    # full: no context_fn passed at all, which torch.compile needs
    kwargs = {"context_fn": partial(create_selective_checkpoint_contexts, _selective_policy)} if mode == "selective" else {}
    for block in model.transformer.h:
        block.checkpoint_kwargs = kwargs


def parallelize(model: GPT, mesh: DeviceMesh | None, compile: bool = False, param_dtype: torch.dtype | None = None,
                activation_checkpointing: str = "none", plan: dict[str, ParallelStyle] = TP_PLAN) -> GPT:
    """TP on mesh["tensor_parallel"] with `plan`, then per block checkpointing and torch.compile, then FSDP2 on
    mesh["data_parallel"] (the order: docs/train.md, "How the model is split"); mesh=None: no TP and no FSDP2.
    param_dtype (bf16-mixed): FSDP2 gathers parameters in it, reduces gradients in float32. Idempotent."""
    if is_parallelized(model):
        return model
    layout = layout_of(mesh=mesh)
    validate_layout(model.config, tp=layout.tp, dp=layout.dp)
    check_compiled_ac(activation_checkpointing, compile, layout.tp)

    # 1. Tensor parallelism. parallelize_module registers new Parameters, which unties wte and lm_head:
    #    both are Shard(0) over the vocabulary, so the tie is restored by pointing lm_head at wte's new DTensor.
    if layout.tp > 1:
        parallelize_module(model, mesh["tensor_parallel"], plan)
        model.tie_weights()

    # 2. Activation checkpointing, then 3. torch.compile, per block and in place (no _orig_mod in parameter names).
    apply_ac(model, activation_checkpointing)
    if compile:
        for block in model.transformer.h:
            block.compile()

    # 4. FSDP2 over the data-parallel dim: each block is a unit, the root takes embeddings, ln_f and lm_head.
    if layout.dp > 1:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
        for module in (*model.transformer.h, model):
            fully_shard(module, mesh=mesh["data_parallel"], mp_policy=mp)
    return model


def _fill_local_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's shard of the full tensor into a (possibly) DTensor parameter, without communication."""
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(full)


def materialize(model: GPT, device: torch.device) -> None:
    """After building on the meta device and parallelizing: allocate the local shards and give them the single-device
    init (GPT.init_weights with rank 0's init_seed). No-op without meta parameters."""
    if not any(p.is_meta for p in model.parameters()):
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        seed = torch.tensor([model.init_seed], dtype=torch.int64, device=device)
        torch.distributed.broadcast(seed, src=0)
        model.init_seed = int(seed.item())
    model.to_empty(device=device)
    model.init_weights(fill=_fill_local_shard)
