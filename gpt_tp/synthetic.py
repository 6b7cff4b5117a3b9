"""Generated token batches for tests, benchmarks and parity checks: no files, deterministic for a seed,
sharded over data-parallel ranks like the real data (every rank of a TP group gets the same batch)."""

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from gpt_tp.parallel import data_parallel_rank_size


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


class SyntheticDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 8, seq_len: int = 64, vocab: int = 1024, seed: int = 1337, val_batches: int = 2):
        """
        Args:
            batch_size: micro-batch rows per data-parallel rank (B).
            seq_len: tokens per row (T).
            vocab: token ids are drawn below this (keep it <= model.vocab_size).
            seed: the generated stream is a function of the seed alone.
            val_batches: batches per validation run (a separate seed).
        """
        super().__init__()
        self.batch_size, self.seq_len, self.vocab, self.seed, self.val_batches = batch_size, seq_len, vocab, seed, val_batches

    def train_dataloader(self):
        rank, size = data_parallel_rank_size(self.trainer)
        return DataLoader(SyntheticTokens(self.batch_size, self.seq_len, self.vocab, self.seed, rank, size), batch_size=None)

    def val_dataloader(self):
        rank, size = data_parallel_rank_size(self.trainer)
        ds = SyntheticTokens(self.batch_size, self.seq_len, self.vocab, self.seed + 1, rank, size, length=self.val_batches)
        return DataLoader(ds, batch_size=None)
