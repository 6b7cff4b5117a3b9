"""TP_PLAN: Megatron-style tensor parallelism with sequence parallelism for gpt_tp.model.GPT on the mesh's
"tensor_parallel" dim; the model file knows nothing of it (docs/train.md, "How the model is split")."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from gpt_tp.parallel.sp import colwise, rowwise, vocab_embedding, vocab_head


class _LocalLayerNorm(nn.LayerNorm):
    """LayerNorm on this rank's sequence slice (B, T/tp, C), with the local copy of its replicated weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to_local(), self.bias.to_local(), self.eps)


class _LocalEmbedding(nn.Embedding):
    """wpe: looks up this rank's positions (T/tp,) in the local copy of its replicated weight."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight.to_local())


_LOCAL = {nn.LayerNorm: _LocalLayerNorm, nn.Embedding: _LocalEmbedding}
SEQUENCE_PARTIAL = tuple(_LOCAL.values())  # modules whose weight gradients are per-rank partial sums over TP


class SequenceReplicated(ParallelStyle):
    """LayerNorms and wpe, Megatron's way: replicated weights used on this rank's sequence slice, so their gradients
    (labelled Replicate) are partial until the step's sync_grads sums them. split_input: cut wpe's positions (T,) to T/tp."""

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


# The plan, keyed by module path. Order within the dict does not matter: each entry parallelizes its own module.
TP_PLAN: dict[str, ParallelStyle] = {
    # token ids (replicated) -> vocab-parallel lookup -> reduce-scatter to the sequence-sharded residual stream
    "transformer.wte": vocab_embedding(),
    "transformer.wpe": SequenceReplicated(split_input=True),
    # attention: LayerNorm on the sequence slice, c_attn all-gathers it in (B, T) order (whole heads per rank),
    # c_proj puts attention's output in token-major order and reduce-scatters
    "transformer.h.*.ln_1": SequenceReplicated(),
    "transformer.h.*.attn.c_attn": colwise(gather="in_order"),
    "transformer.h.*.attn.c_proj": rowwise(reorder_input=True),
    # MLP: the same pattern, the 4C hidden units split over ranks, on the token-major gathered buffer as it is
    "transformer.h.*.ln_2": SequenceReplicated(),
    "transformer.h.*.mlp.c_fc": colwise(gather="token_major"),
    "transformer.h.*.mlp.c_proj": rowwise(reorder_input=False),
    # head: all-gather the sequence, vocab-sharded logits as a DTensor for gpt_tp.parallel.loss.cross_entropy
    "transformer.ln_f": SequenceReplicated(),
    "lm_head": vocab_head(),
}
