"""Fused, vocab-parallel cross-entropy (Megatron-LM's `vocab_parallel_cross_entropy`): each rank reduces its
(N, V / tp) slice of the logits and the ranks all-reduce N numbers, never the logits:
    m   = max_v x_v                                   all-reduce MAX   (N values; only for stability)
    s   = sum_v exp(x_v - m),  x_t - m (0 off-owner)   one all-reduce SUM of both (2N values)
    loss = mean(log s - (x_t - m))
The single-device model computes its loss the same way, without collectives. Targets must be valid token ids (no
ignore_index). One float32 buffer becomes the gradient in place: docs/performance.md, "Speed notes"."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def mask_padded_vocab(logits: torch.Tensor, limit: int | None, offset: int = 0) -> torch.Tensor:
    """``logits`` (..., n) of token ids offset .. offset + n - 1 (the whole vocabulary, or one rank's shard) with the
    ids >= ``limit`` set to -inf (None: none), for scoring and sampling: the vocabulary padding's zero rows in imported
    Hugging Face weights give logit 0, far above GPT-2's real logits."""
    n = logits.shape[-1]
    if limit is None or offset + n <= limit:
        return logits
    return logits.masked_fill(torch.arange(offset, offset + n, device=logits.device) >= limit, float("-inf"))


def vocab_shard_offset(logits: DTensor) -> int:
    """The first token id of this rank's shard of a DTensor evenly sharded over its last (vocabulary) dim."""
    mesh, placements = logits.device_mesh, logits.placements
    dims = [i for i, p in enumerate(placements) if p.is_shard() and p.dim % logits.ndim == logits.ndim - 1]
    n = logits.to_local().shape[-1]
    if len(dims) != 1 or n * mesh.size(dims[0]) != logits.shape[-1]:
        raise ValueError(f"expected logits evenly sharded over the vocabulary on one mesh dim, got {placements} "
                         f"for {logits.shape[-1]} classes")
    return mesh.get_local_rank(dims[0]) * n


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
        # logits (N, V_local): this rank's vocabulary slice [vocab_start, vocab_start + V_local); targets (N,)
        n, v_local = logits.shape
        acc = torch.promote_types(logits.dtype, torch.float32)  # reduce bf16 logits in float32
        m = logits.amax(dim=-1, keepdim=True).to(acc)  # (N, 1)
        if group is not None:
            dist.all_reduce(m, dist.ReduceOp.MAX, group=group)
        # (N, V_local) float32, one new buffer: bf16 logits are copied to float32 and shifted in place (torch.sub on
        # CPU would first cast them into a second float32 buffer; docs/scale.md, "transient")
        e = torch.sub(logits, m) if logits.dtype == acc else logits.to(acc).sub_(m)
        local = targets - vocab_start
        owned = (local >= 0) & (local < v_local)  # (N,) this rank holds the target's logit
        idx = local.clamp(0, v_local - 1).unsqueeze(1)  # (N, 1)
        stats = torch.empty(2, n, dtype=acc, device=logits.device)
        torch.mul(e.gather(1, idx).squeeze(1), owned, out=stats[1])  # x_t - m on the owning rank, 0 elsewhere
        e.exp_()
        torch.sum(e, dim=-1, out=stats[0])  # this slice's sum of exp(x - m)
        if group is not None:
            dist.all_reduce(stats, dist.ReduceOp.SUM, group=group)
        s, target_logit = stats[0], stats[1]
        ctx.save_for_backward(e, s, idx, owned)
        ctx.dtype = logits.dtype
        return (s.log() - target_logit).mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        e, s, idx, owned = ctx.saved_tensors
        scale = grad_loss / e.shape[0]  # d(mean)/d(loss_i)
        grad = e.mul_((scale / s).unsqueeze(1))  # softmax * scale, in place: (N, V_local)
        grad.scatter_add_(1, idx, (-scale * owned).unsqueeze(1).to(grad.dtype))  # - onehot(target) * scale
        return grad.to(ctx.dtype), None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits (or lm_head's Shard(-1) DTensor on the TP mesh) against (B, T) targets:
    a plain scalar tensor, the same on every rank; backward needs no context manager."""
    group, vocab_start, local = None, 0, logits
    if isinstance(logits, DTensor):
        if logits.device_mesh.ndim != 1 or logits.placements != (Shard(logits.ndim - 1),):
            raise ValueError(f"cross_entropy expects logits sharded over the vocabulary on a 1-D mesh, got "
                             f"{logits.placements} on {logits.device_mesh}: check lm_head's entry in gpt_tp.parallel.TP_PLAN")
        group = logits.device_mesh.get_group()
        vocab_start = vocab_shard_offset(logits)  # vocab_size % tp: checked by validate_layout, and here again
        local = logits.to_local()  # differentiable: its gradient comes back as a Shard(-1) DTensor
    return _VocabParallelCrossEntropy.apply(local.flatten(0, 1), targets.flatten(), vocab_start, group)  # (B*T, V_local), (B*T,)
