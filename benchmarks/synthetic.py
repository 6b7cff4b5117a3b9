"""Generated token batches for benchmarks and parity checks: no files, deterministic for a seed, sharded over
data-parallel ranks like the real data (every rank of a TP group gets the same batch)."""

import torch
from torch.utils.data import IterableDataset


class SyntheticTokens(IterableDataset):
    """Rows of learnable sequences: each row counts up from a random start with a random stride (mod `vocab`),
    so the loss falls quickly. Global batch g holds rows for every DP rank; rank r takes its slice."""

    def __init__(self, batch_size: int, seq_len: int, vocab: int, seed: int, dp_rank: int = 0, dp_size: int = 1, length: int | None = None):
        self.batch_size, self.seq_len, self.vocab, self.seed = batch_size, seq_len, vocab, seed
        self.dp_rank, self.dp_size, self.length = dp_rank, dp_size, length

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        rows = self.batch_size * self.dp_size
        start = torch.randint(0, self.vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 8, (rows, 1), generator=g)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab  # (rows, T + 1)
        seq = seq[self.dp_rank * self.batch_size : (self.dp_rank + 1) * self.batch_size]  # (B, T + 1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # x, y: (B, T)

    def __iter__(self):
        index = 0
        while self.length is None or index < self.length:
            yield self.batch(index)
            index += 1
