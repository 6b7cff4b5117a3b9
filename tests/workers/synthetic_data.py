"""A LightningDataModule of generated batches (benchmarks.synthetic.SyntheticTokens) for the tests: no files."""

import lightning as L
from torch.utils.data import DataLoader

from benchmarks.synthetic import SyntheticTokens
from gpt_tp.ranks import layout_of


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
        rank, size = (layout := layout_of(self.trainer)).dp_rank, layout.dp
        return DataLoader(SyntheticTokens(self.batch_size, self.seq_len, self.vocab, self.seed, rank, size), batch_size=None)

    def val_dataloader(self):
        rank, size = (layout := layout_of(self.trainer)).dp_rank, layout.dp
        ds = SyntheticTokens(self.batch_size, self.seq_len, self.vocab, self.seed + 1, rank, size, length=self.val_batches)
        return DataLoader(ds, batch_size=None)
