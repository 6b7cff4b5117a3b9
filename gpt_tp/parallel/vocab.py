"""Scoring and sampling leave the vocabulary padding (ids 50257 .. vocab_size - 1) out of the softmax: imported Hugging
Face weights have zero rows there, whose logit 0 lies far above GPT-2's real logits."""

import torch
from torch.distributed.tensor import DTensor


def mask_padded_vocab(logits: torch.Tensor, limit: int | None, offset: int = 0) -> torch.Tensor:
    """``logits`` (..., n) of token ids offset .. offset + n - 1 (the whole vocabulary, or one rank's shard of a
    vocab-sharded tensor) with the ids >= ``limit`` set to -inf. None: nothing masked."""
    n = logits.shape[-1]
    if limit is None or offset + n <= limit:
        return logits
    ids = torch.arange(offset, offset + n, device=logits.device)  # (n,)
    return logits.masked_fill(ids >= limit, float("-inf"))


def vocab_shard_offset(logits: DTensor) -> int:
    """The first token id of this rank's shard of a DTensor evenly sharded over its last (vocabulary) dim."""
    mesh, placements = logits.device_mesh, logits.placements
    dims = [i for i, p in enumerate(placements) if p.is_shard() and p.dim % logits.ndim == logits.ndim - 1]
    n = logits.to_local().shape[-1]
    if len(dims) != 1 or n * mesh.size(dims[0]) != logits.shape[-1]:
        raise ValueError(f"expected logits evenly sharded over the vocabulary on one mesh dim, got {placements} "
                         f"for {logits.shape[-1]} classes")
    return mesh.get_local_rank(dims[0]) * n
