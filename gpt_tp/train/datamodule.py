"""The LightningDataModule that streams token shards (format and reading scheme: gpt_tp.data.shards)."""

import itertools
import math

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gpt_tp.data.shards import GPT2_VOCAB, TokenStream, find_shards
from gpt_tp.errors import DataError
from gpt_tp.infer.predict import PromptBatches, Prompts
from gpt_tp.ranks import layout_of, model_vocab


class TokenBatches(IterableDataset):
    """One data-parallel rank's (x, y) int64 batches of shape (batch_size, seq_len), its slice of each global batch
    (docs/data.md), ids checked on construction. Iteration runs from global batch ``start`` for ``num_batches``
    batches, or forever over epochs; worker ``w`` of ``W`` makes batches ``start + w, start + w + W, ...``."""

    def __init__(self, paths, batch_size: int, seq_len: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 1337, num_batches: int | None = None, split: str = "train", vocab_size: int = GPT2_VOCAB):
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        self.stream = TokenStream(paths, vocab_size)
        self.batch_size, self.seq_len, self.seed, self.split = batch_size, seq_len, seed, split
        self.dp_rank, self.dp_size, self.start, self.num_batches = dp_rank, dp_size, 0, num_batches
        self.rank_tokens = batch_size * seq_len
        self.span = self.rank_tokens * dp_size  # tokens one global batch advances
        n = len(self.stream)
        if n < self.span + 1:
            raise DataError(f"{split} split in {self.stream.paths[0].parent} has {n} tokens, too few for one batch of "
                            f"batch_size*seq_len*dp_size+1 = {batch_size}*{seq_len}*{dp_size}+1 = {self.span + 1}: "
                            "lower batch_size/seq_len or add data")

    @property
    def batches_per_epoch0(self) -> int:
        """Global batches in epoch 0 (the most any epoch has)."""
        return (len(self.stream) - 1) // self.span

    def epoch_layout(self, epoch: int) -> tuple[TokenStream, int, int]:
        """(stream in this epoch's shard order, first token offset, number of global batches)."""
        if epoch == 0:
            return self.stream, 0, self.batches_per_epoch0
        rng = np.random.default_rng([self.seed, epoch])
        stream = self.stream.reordered(rng.permutation(len(self.stream.paths)))
        offset = int(rng.integers(min(self.seq_len, len(self.stream) - self.span)))  # below len - span: one batch fits
        return stream, offset, (len(self.stream) - 1 - offset) // self.span

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        end = math.inf if self.num_batches is None else self.start + self.num_batches
        epoch, k0 = 0, 0  # the epoch holding global batch k, and its first global batch
        stream, offset, n = self.epoch_layout(epoch)
        for k in itertools.takewhile(lambda k: k < end, itertools.count(self.start + wid, nw)):
            while k >= k0 + n:  # next epoch
                epoch, k0 = epoch + 1, k0 + n
                stream, offset, n = self.epoch_layout(epoch)
            lo = offset + (k - k0) * self.span + self.dp_rank * self.rank_tokens
            buf = torch.from_numpy(stream.read(lo, lo + self.rank_tokens + 1).astype(np.int64))  # B*T + 1 tokens
            yield buf[:-1].view(self.batch_size, self.seq_len), buf[1:].view(self.batch_size, self.seq_len)  # (B, T)


class _ResumableLoader(DataLoader):
    """Each ``iter()`` starts the dataset at ``start_fn()`` (read before workers start) and calls ``on_yield()`` per
    batch returned. The hooks are the loader's: workers get the dataset without the data module and its trainer."""

    def __init__(self, dataset, start_fn, on_yield, **kwargs):
        super().__init__(dataset, **kwargs)
        self.start_fn, self.on_yield = start_fn, on_yield

    def __iter__(self):
        self.dataset.start = self.start_fn()
        for batch in super().__iter__():
            self.on_yield()
            yield batch


class GPTDataModule(L.LightningDataModule):
    """Streams GPT-2 token shards (build-nanogpt format) as (x, y) batches: endless training stream, resumable.

    Args:
        data_dir: folder of ``*_train_NNNNNN.npy`` / ``*_val_NNNNNN.npy`` shards (relative: also under the repo root).
        batch_size: micro-batch size B per data-parallel rank.
        seq_len: sequence length T.
        val_batches: batches per validation run (the same each time); 0 disables validation data.
        seed: fixes the shard order and offset of every epoch after the first.
        num_workers: DataLoader worker processes (0 = load in the training process).
        pin_memory: pin batches for faster host-to-GPU copies.
        prompts: what ``predict`` continues (``cli.py predict`` links its --prompt ... --seed flags here).
    """

    def __init__(self, data_dir: str = "data/sample", batch_size: int = 16, seq_len: int = 1024,
                 val_batches: int = 20, seed: int = 1337, num_workers: int = 0, pin_memory: bool = False,
                 prompts: Prompts | None = None):
        super().__init__()
        if val_batches < 0 or num_workers < 0:
            raise DataError(f"val_batches and num_workers must be >= 0, got {val_batches} and {num_workers}")
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"data.batch_size={batch_size} and data.seq_len={seq_len} must be >= 1")
        self.data_dir, self.batch_size, self.seq_len, self.val_batches = data_dir, batch_size, seq_len, val_batches
        self.seed, self.num_workers, self.pin_memory = seed, num_workers, pin_memory
        self.prompts = prompts or Prompts()
        self.train_data = self.val_data = None  # TokenBatches once set up
        self._start = 0  # global train batches consumed when the train loader last started (or from a checkpoint)
        self._consumed = 0  # training batches the trainer took since then
        self._yielded = 0  # batches the train loader returned since then

    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this process among data-parallel replicas (TP ranks share a rank): the trainer's layout."""
        return (layout := layout_of(getattr(self, "trainer", None))).dp_rank, layout.dp

    def setup(self, stage: str | None = None) -> None:
        """Build this rank's datasets. Every rank checks every shard's ids (below the model's vocabulary, else 50257)
        here, before any step, so a bad id stops all ranks alike and none waits in a collective."""
        rank, size = self.data_parallel()
        vocab = model_vocab(getattr(getattr(self, "trainer", None), "lightning_module", None)) or GPT2_VOCAB
        if stage in (None, "fit"):
            self.train_data = TokenBatches(find_shards(self.data_dir, "train"), self.batch_size, self.seq_len,
                                           rank, size, self.seed, split="train", vocab_size=vocab)
        if stage in (None, "fit", "validate") and self.val_batches > 0:
            val = TokenBatches(find_shards(self.data_dir, "val"), self.batch_size, self.seq_len,
                               rank, size, self.seed, split="val", vocab_size=vocab)
            n = min(self.val_batches, val.batches_per_epoch0)
            if n < self.val_batches:
                rank_zero_warn(f"val split in {val.stream.paths[0].parent} holds only {n} batches of "
                               f"{self.batch_size}x{self.seq_len}x{size} ranks: validating on {n}, not {self.val_batches}")
            val.num_batches = n
            self.val_data = val

    def train_dataloader(self) -> DataLoader:
        if self.train_data is None:
            self.setup("fit")
        return _ResumableLoader(self.train_data, self._train_position_at_iter, self._count_yield, batch_size=None,
                                num_workers=self.num_workers, pin_memory=self.pin_memory)

    def val_dataloader(self) -> DataLoader:
        if self.val_data is None and self.val_batches > 0:
            self.setup("validate")
        return [] if self.val_data is None else DataLoader(self.val_data, batch_size=None, num_workers=self.num_workers,
                                                           pin_memory=self.pin_memory)

    def predict_dataloader(self) -> PromptBatches:
        return PromptBatches(self.prompts)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Count the training batches the trainer takes for its steps: Lightning moves a batch to the device just
        before the step that uses it, while its loader runs one batch ahead (DataLoader workers further)."""
        if self.trainer is not None and self.trainer.training:
            self._consumed += 1
        return batch

    def _train_position_at_iter(self) -> int:
        self._start, self._consumed, self._yielded = self.train_position(), 0, 0
        return self._start

    def _count_yield(self) -> None:
        self._yielded += 1

    def train_position(self) -> int:
        """The index of the next global batch to train on (without a trainer: counted by the loader's yields)."""
        return self._start + (self._consumed if self.trainer is not None else self._yielded)

    def state_dict(self) -> dict:
        return {"train_batches": self.train_position(), "batch_size": self.batch_size, "seq_len": self.seq_len,
                "dp_size": self.data_parallel()[1], "seed": self.seed,
                "accumulate_grad_batches": getattr(self.trainer, "accumulate_grad_batches", None)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at the saved position (after a change of global batch geometry: at its token position). Exact
        where the tokens per optimizer step are kept, the position is a whole number of new global batches, and the
        saved batch count (Lightning's batch index in the endless epoch) is a multiple of the new accumulation, so
        Lightning's accumulation starts a whole step; else a warning says it is not."""
        k = int(state_dict["train_batches"])
        old = state_dict["batch_size"] * state_dict["seq_len"] * state_dict["dp_size"]
        new = self.batch_size * self.seq_len * self.data_parallel()[1]
        was, now = state_dict.get("accumulate_grad_batches"), getattr(self.trainer, "accumulate_grad_batches", None)
        if old != new:
            if not (was and now and old * was == new * now and k * old % new == 0 and k % now == 0):
                rank_zero_warn(f"checkpoint data position was saved with {old} tokens per global batch, now {new}: "
                               "resuming at the same token position, not an exact continuation")
            k = -(-k * old // new)
        interval = getattr(self.trainer, "val_check_interval", None)
        if was and now and was != now and isinstance(interval, int):
            rank_zero_warn(f"trainer.val_check_interval={interval} counts micro-batches: with "
                           f"trainer.accumulate_grad_batches={now} (was {was}) validation comes every "
                           f"{interval / now:g} optimizer steps, not every {interval / was:g}; set "
                           f"trainer.val_check_interval={interval * now / was:g} to keep the steps it validates at")
        if state_dict.get("seed", self.seed) != self.seed:
            rank_zero_warn(f"checkpoint data seed {state_dict['seed']} differs from seed {self.seed}: "
                           "later epochs will be ordered differently")
        self._start, self._consumed, self._yielded = k, 0, 0
