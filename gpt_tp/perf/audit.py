"""Count what one training step communicates and stores, against the minimum derived here.

Megatron-LM's sequence-parallel minimum for this GPT-2, per training step on one TP group (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2.2):
  per block, forward:  all-gather before attention, reduce-scatter after it; the same around the MLP
                       -> 2 all-gathers + 2 reduce-scatters
  per block, backward: the conjugates (reduce-scatter for each all-gather, all-gather for each reduce-scatter)
                       -> 2 all-gathers + 2 reduce-scatters
  token embedding:     vocab-parallel lookup, reduce-scatter into the sequence-sharded stream (fwd), all-gather (bwd)
  lm_head:             all-gather the sequence before the column-parallel head (fwd), reduce-scatter (bwd)
  cross-entropy:       vocab-parallel (gpt_tp.parallel.loss): all-reduce of the max, then one all-reduce of the sum of exps
                       and the target logit together (fwd); nothing in backward
  replicated params:   LayerNorm weights/biases and wpe see one sequence slice per rank: their gradients are summed
                       in one flat all-reduce (gpt_tp.parallel.reduce_partial_grads)
On the TP group, for L blocks: all_gather 4L + 2, reduce_scatter 4L + 2, all_reduce 3. (wpe costs no extra
collective: each rank looks up its own positions and the weight gradient joins the flat all-reduce.)

FSDP2 over DP (ZeRO-3, one unit per block and one root unit with the embeddings, ln_f and lm_head): each unit's
parameters are all-gathered before its forward (L + 1), each block's again before its backward (L; the root stays
gathered), and each unit's gradients reduce-scattered (L + 1): all_gather 2L + 1, reduce_scatter L + 1 on the DP
group. It reduce-scatters the replicated parameters' gradients as they are (per-rank partial sums labelled
Replicate, see gpt_tp.parallel.SequenceReplicated), so it adds no all-reduce; the TP sum then moves 1/dp of them.

Gradient clipping: one all-reduce of this rank's squared-norm share over the whole mesh (the TP or DP group on a
1-D mesh, the default group on the 2-D one).
"""

from collections import Counter

import torch
from torch.distributed.tensor import DTensor

from gpt_tp.perf.bench import CollectiveRecorder
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.parallel import clip_grad_norm


def minimum_collectives(n_layer: int, dp: int = 1, tp: int = 2) -> dict[str, dict[str, int]]:
    """Collectives in one training step on a dp x tp mesh by group ("tensor_parallel", "data_parallel", "world")
    and kind (see the module docstring for the derivation)."""
    L, out = n_layer, {}
    if tp > 1:
        out["tensor_parallel"] = {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L + 2, "all_reduce": 3}
    if dp > 1:
        out["data_parallel"] = {"all_gather": 2 * L + 1, "reduce_scatter": L + 1}
    if dp * tp > 1:  # the grad norm
        group = out.setdefault("world" if dp > 1 and tp > 1 else "data_parallel" if dp > 1 else "tensor_parallel", {})
        group["all_reduce"] = group.get("all_reduce", 0) + 1
    return out


def megatron_sp_minimum(n_layer: int) -> dict[str, int]:
    """Collectives in one training step at TP > 1, DP = 1 (see the module docstring for the derivation)."""
    return minimum_collectives(n_layer, dp=1, tp=2)["tensor_parallel"]


def step_collectives(model, optimizer, x: torch.Tensor, y: torch.Tensor, max_norm: float = 1.0,
                     groups: dict[str, tuple[str, int]] | None = None) -> dict[str, dict]:
    """Run one full training step (forward, vocab-parallel loss, backward, grad reduction, clip, optimizer step) and
    return the collectives of each phase by kind, plus 'total'. With `groups` (gpt_tp.perf.bench.groups_of(mesh)),
    also 'by_group': the whole step's collectives by group label and kind. Gradients are left in place (peak
    memory)."""
    phases, by_group = {}, {}

    def record(phase, fn):
        rec = CollectiveRecorder(groups or {})
        with rec:
            out = fn()
        phases[phase] = Counter(kind for _, kind, _, _ in rec.records)
        for label, kind, _, _ in rec.records:
            by_group.setdefault(label, Counter())[kind] += 1
        return out

    loss = record("forward", lambda: cross_entropy(model(x), y))
    record("backward", loss.backward)
    record("grad_sync_and_clip", lambda: clip_grad_norm(model, max_norm))
    record("optimizer", optimizer.step)
    phases["total"] = sum(phases.values(), Counter())
    out = {k: dict(v) for k, v in phases.items()}
    if groups is not None:
        out["by_group"] = {k: dict(v) for k, v in sorted(by_group.items())}
    return out


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
