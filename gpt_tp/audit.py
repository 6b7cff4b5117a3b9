"""Count what one tensor-parallel training step communicates and stores, against the Megatron minimum.

Megatron-LM's sequence-parallel minimum for this GPT-2, per training step on one TP group (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2.2):
  per block, forward:  all-gather before attention, reduce-scatter after it; the same around the MLP
                       -> 2 all-gathers + 2 reduce-scatters
  per block, backward: the conjugates (reduce-scatter for each all-gather, all-gather for each reduce-scatter)
                       -> 2 all-gathers + 2 reduce-scatters
  token embedding:     vocab-parallel lookup, reduce-scatter into the sequence-sharded stream (fwd), all-gather (bwd)
  lm_head:             all-gather the sequence before the column-parallel head (fwd), reduce-scatter (bwd)
  cross-entropy:       vocab-parallel (gpt_tp.loss): all-reduce of the max, then one all-reduce of the sum of exps
                       and the target logit together (fwd); nothing in backward
  replicated params:   LayerNorm weights/biases and wpe see one sequence slice per rank: their gradients are summed
                       in one coalesced all-reduce
  gradient clipping:   one all-reduce of the squared-norm partials
Total for L blocks: all_gather 4L + 2, reduce_scatter 4L + 2, all_reduce 4. (wpe costs no extra collective:
each rank looks up its own positions and the weight gradient joins the coalesced all-reduce.)
"""

from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from gpt_tp.loss import cross_entropy
from gpt_tp.parallel import clip_grad_norm

# CommDebugMode's names -> short ones; functional and in-place c10d ops count as one kind
KINDS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "_allgather_base_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
}


def megatron_sp_minimum(n_layer: int) -> dict[str, int]:
    """Collectives in one training step at TP > 1 (see the module docstring for the derivation)."""
    return {"all_gather": 4 * n_layer + 2, "reduce_scatter": 4 * n_layer + 2, "all_reduce": 4}


def _kinds(mode: CommDebugMode) -> Counter:
    out = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        out[KINDS.get(name, name)] += n
    return out


def step_collectives(model, optimizer, x: torch.Tensor, y: torch.Tensor, max_norm: float = 1.0) -> dict[str, dict[str, int]]:
    """Run one full training step (forward, vocab-parallel loss, backward, grad reduction, clip, optimizer step) and
    return the collectives of each phase by kind, plus 'total'. Gradients are left in place (peak memory)."""
    phases = {}
    with CommDebugMode() as mode:
        loss = cross_entropy(model(x), y)
    phases["forward"] = _kinds(mode)
    with CommDebugMode() as mode:
        loss.backward()
    phases["backward"] = _kinds(mode)
    with CommDebugMode() as mode:
        clip_grad_norm(model, max_norm)
    phases["grad_sync_and_clip"] = _kinds(mode)
    with CommDebugMode() as mode:
        optimizer.step()
    phases["optimizer"] = _kinds(mode)
    phases["total"] = sum(phases.values(), Counter())
    return {k: dict(v) for k, v in phases.items()}


def state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only)."""

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list({id(p): p for p in model.parameters()}.values())
    out = {
        "params": sum(local(p) for p in params),
        "grads": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
    }
    out["total"] = sum(out.values())
    return out
