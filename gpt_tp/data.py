"""Token shards and the LightningDataModule that streams them.

Shard format (build-nanogpt's, read and written unchanged): a standard ``.npy`` file holding a
1-D ``uint16`` array of GPT-2 token ids, named ``{prefix}_{split}_{index:06d}.npy`` with split
``val`` or ``train``. Each document is ``[<|endoftext|>] + tokens``; documents run on across
shard boundaries. build-nanogpt writes shard 0 as ``val`` and the rest as ``train``.

Reading scheme (cleaner than build-nanogpt's DataLoaderLite, which drops each shard's tail):
the shards of a split are one concatenated token stream, read through small memory maps of only
the bytes a batch needs, so memory does not grow with shard size or count. Global batch ``k`` is
the span of ``B*T*dp_size + 1`` tokens starting at ``k*B*T*dp_size`` (within an epoch); data-parallel
rank ``r`` takes tokens ``[r*B*T, (r+1)*B*T + 1)`` of that span, so the ``dp_size`` ranks together
see exactly what one device with batch ``B*dp_size`` would see. Tensor-parallel ranks are not
data-parallel ranks: all ranks of one TP group get the identical batch. Epoch 0 reads the shards in
file order from token 0 (as build-nanogpt); each later epoch reads them in a seed-determined
permutation, starting at a seed-determined offset in ``[0, T)``, so windows do not repeat exactly.
"""

import itertools
import math
import os
import re
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gpt_tp.errors import UserError
from gpt_tp.parallel import data_parallel_rank_size

EOT_TOKEN = 50256  # <|endoftext|> of GPT-2's BPE (tiktoken "gpt2" == "r50k_base")
GPT2_VOCAB = EOT_TOKEN + 1  # ids GPT-2's BPE produces; a model's vocab_size above it (50304) is padding
SPLITS = ("train", "val")
SHARD_RE = re.compile(r"^(?P<prefix>.+)_(?P<split>train|val)_(?P<index>\d{6})\.npy$")
_SHARD_LIKE_RE = re.compile(r"^(?P<prefix>.+)_(?P<split>train|val)_(?P<index>\d+)\.[A-Za-z0-9]+$")
REPO_ROOT = Path(__file__).resolve().parent.parent


class DataError(UserError):
    """Bad data input: the message names the file or flag at fault and how to fix it."""


# ----------------------------------------------------------------------------------------------
# token ids


def check_token_ids(ids, vocab_size: int, where: str) -> None:
    """Raise DataError unless every id in ``ids`` (numpy array or torch tensor, any shape) lies in
    ``0 .. min(50257, vocab_size) - 1``: a GPT-2 BPE id the model has an embedding row for.

    The message names ``where``, the first bad position and its id, and the fix. One pass over the
    data (its min and max); the position is searched only when an id is out of range.
    """
    limit = min(GPT2_VOCAB, int(vocab_size))
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex():
            raise DataError(f"{where}: token ids must be integers, got dtype {ids.dtype}")
        if ids.numel() == 0:
            return
        lo, hi = (0 if ids.dtype == torch.uint8 else int(ids.min())), int(ids.max())
    else:
        ids = np.asarray(ids)
        if ids.size == 0:
            return
        if not np.issubdtype(ids.dtype, np.integer):
            raise DataError(f"{where}: token ids must be integers, got dtype {ids.dtype}")
        lo, hi = (0 if np.issubdtype(ids.dtype, np.unsignedinteger) else int(ids.min())), int(ids.max())
    if lo >= 0 and hi < limit:
        return
    bad = (ids < 0) | (ids >= limit)
    flat = int(torch.argmax(bad.flatten().to(torch.uint8))) if isinstance(ids, torch.Tensor) else int(np.argmax(bad.ravel()))
    pos = np.unravel_index(flat, tuple(ids.shape)) if len(ids.shape) > 1 else flat
    pos = tuple(int(i) for i in pos) if isinstance(pos, tuple) else pos
    value = int(ids.flatten()[flat]) if isinstance(ids, torch.Tensor) else int(ids.ravel()[flat])
    if value < 0:
        why = "is negative: the data is corrupt; rebuild it with python -m gpt_tp.prepare"
    elif value >= GPT2_VOCAB:
        why = (f"is not a GPT-2 BPE id (0..{GPT2_VOCAB - 1}): the data was not tokenized with GPT-2's BPE "
               "(tiktoken r50k_base) or is corrupt; rebuild it with python -m gpt_tp.prepare")
    else:
        why = (f"is outside the model's vocabulary (0..{limit - 1}): set model.vocab_size to at least {GPT2_VOCAB} "
               "(e.g. 50304), and model.vocab_used, if set, to 50257")
    raise DataError(f"{where}: token id {value} at position {pos} {why}")


# ----------------------------------------------------------------------------------------------
# shard files


def shard_name(prefix: str, split: str, index: int) -> str:
    """build-nanogpt's file name of shard ``index``: ``{prefix}_{split}_{index:06d}.npy``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return f"{prefix}_{split}_{index:06d}.npy"


def write_shard(path, tokens) -> None:
    """Write ``tokens`` as a uint16 ``.npy`` shard (build-nanogpt format) at ``path``, atomically.

    The array is written to ``path + ".tmp"`` and renamed, so a partly written shard never appears
    under its final name. Raises DataError if a token id does not fit uint16.
    """
    path = os.fspath(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"{path}: a shard must be a 1-D token array, got shape {arr.shape}")
    if arr.dtype != np.uint16:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"{path}: token ids must be integers, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= 2**16)) if arr.size else []
        if len(bad):
            raise DataError(
                f"{path}: token id {int(arr[bad[0]])} (at position {int(bad[0])}) does not fit uint16 (0..65535); "
                "shards hold GPT-2 BPE ids (vocab 50257): use the gpt2/r50k_base encoding"
            )
        arr = arr.astype(np.uint16)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:  # a file object: np.save must not append another ".npy"
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_header(path) -> tuple[int, int]:
    """Check that ``path`` is a 1-D little-endian uint16 ``.npy`` file; return (num_tokens, data offset).

    Reads only the header, never the data. Raises DataError naming the file otherwise.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            offset = f.tell()
    except (ValueError, OSError, SyntaxError) as e:
        raise DataError(f"{path}: not a readable .npy token shard ({e}); rebuild it with python -m gpt_tp.prepare") from e
    if dtype != np.dtype("<u2") or len(shape) != 1 or fortran:
        raise DataError(
            f"{path}: expected a 1-D uint16 token array (build-nanogpt shard format), got dtype {dtype} shape {shape}; "
            "rebuild it with python -m gpt_tp.prepare"
        )
    expected = offset + 2 * shape[0]
    actual = os.path.getsize(path)
    if actual != expected:
        raise DataError(f"{path}: file is {actual} bytes but its header needs {expected}: truncated or corrupt, rebuild it")
    return shape[0], offset


def read_shard(path, mmap: bool = True) -> np.ndarray:
    """Return shard ``path`` as a 1-D uint16 array, memory-mapped read-only unless ``mmap=False``."""
    shard_header(path)
    return np.load(os.fspath(path), mmap_mode="r" if mmap else None, allow_pickle=False)


CHECK_CHUNK = 1 << 22  # tokens (8 MB) mapped at a time while checking a shard
_checked_shards: set = set()  # (file identity, id limit) of the shards checked in this process


def check_shard(path, vocab_size: int = GPT2_VOCAB) -> None:
    """``check_token_ids`` over the whole shard ``path`` (DataError naming the file, position and id),
    once per process for each version of the file: a shard opened again is not read again."""
    path = os.fspath(path)
    st = os.stat(path)
    limit = min(GPT2_VOCAB, int(vocab_size))
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, limit)
    if key in _checked_shards:
        return
    if shard_max(path) >= limit:
        check_token_ids(read_shard(path), vocab_size, path)  # finds and names the first bad id
    _checked_shards.add(key)


def shard_max(path) -> int:
    """The largest token id in shard ``path`` (-1 if empty), read ``CHECK_CHUNK`` tokens at a time, so
    memory does not grow with the shard's size."""
    n, offset = shard_header(path)
    hi = -1
    for lo in range(0, n, CHECK_CHUNK):
        chunk = np.memmap(path, dtype=np.uint16, mode="r", offset=offset + 2 * lo, shape=(min(CHECK_CHUNK, n - lo),))
        hi = max(hi, int(chunk.max()))
        del chunk
    return hi


def resolve_data_dir(data_dir) -> Path:
    """``data_dir`` as given, or, when a relative path is missing from the working directory, the
    same path under the repository root (so ``data/sample`` works from anywhere)."""
    p = Path(data_dir).expanduser()
    if not p.exists() and not p.is_absolute() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p
    return p


def find_shards(data_dir, split: str) -> list[Path]:
    """The shard files of ``split`` in ``data_dir``, in index order (names like build-nanogpt's)."""
    d = resolve_data_dir(data_dir)
    if not d.is_dir():
        raise DataError(
            f"data directory {os.fspath(data_dir)!r} does not exist (or is not a directory): "
            "set data_dir to a folder of token shards, e.g. made by python -m gpt_tp.prepare"
        )
    found, prefixes = [], set()
    for name in sorted(os.listdir(d)):
        m = SHARD_RE.match(name)
        if m is None:
            m2 = _SHARD_LIKE_RE.match(name)
            if m2 and m2.group("split") == split and not name.endswith((".tmp", ".json", ".md", ".txt")):
                raise DataError(
                    f"{d / name}: looks like a {split} shard but is not a uint16 .npy shard named "
                    f"PREFIX_{split}_NNNNNN.npy (another format, e.g. llm.c .bin?); rebuild with python -m gpt_tp.prepare"
                )
            continue
        if m.group("split") == split:
            found.append((int(m.group("index")), d / name))
            prefixes.add(m.group("prefix"))
    if not found:
        raise DataError(
            f"no {split} shards (*_{split}_NNNNNN.npy) in {d}: point data_dir at a folder made by "
            "python -m gpt_tp.prepare or build-nanogpt's fineweb.py"
        )
    if len(prefixes) > 1:
        raise DataError(f"{d}: {split} shards with several prefixes {sorted(prefixes)}: keep one dataset per folder")
    return [p for _, p in sorted(found)]


class TokenStream:
    """Several shards read as one concatenated token stream.

    Opening checks every shard's header and token ids (``check_shard``: ids below
    ``min(50257, vocab_size)``), so a bad shard raises DataError here, before any batch is read.
    ``read(start, stop)`` maps only the bytes it needs (one small ``np.memmap`` per shard touched,
    dropped right after copying), so resident memory does not depend on shard size or count.
    """

    def __init__(self, paths, vocab_size: int = GPT2_VOCAB):
        self.paths = [Path(p) for p in paths]
        headers = [shard_header(p) for p in self.paths]
        for p in self.paths:
            check_shard(p, vocab_size)
        self.sizes = np.array([n for n, _ in headers], dtype=np.int64)
        self.data_offsets = [off for _, off in headers]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def reordered(self, order) -> "TokenStream":
        """The same shards in another order (headers are not read again)."""
        s = TokenStream.__new__(TokenStream)
        s.paths = [self.paths[i] for i in order]
        s.sizes = self.sizes[list(order)]
        s.data_offsets = [self.data_offsets[i] for i in order]
        s.starts = np.concatenate([[0], np.cumsum(s.sizes)])
        return s

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream as a new uint16 array (may cross shards)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"read [{start}, {stop}) outside stream of {len(self)} tokens")
        out = np.empty(stop - start, dtype=np.uint16)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo = pos - int(self.starts[i])
            n = min(stop - pos, int(self.sizes[i]) - lo)
            if n > 0:
                m = np.memmap(self.paths[i], dtype=np.uint16, mode="r", offset=self.data_offsets[i] + 2 * lo, shape=(n,))
                out[pos - start : pos - start + n] = m
                del m
            pos += n
            i += 1
        return out


# ----------------------------------------------------------------------------------------------
# batches


class TokenBatches(IterableDataset):
    """(x, y) int64 batches of shape (batch_size, seq_len) for one data-parallel rank.

    Global batch ``k`` covers ``batch_size * seq_len * dp_size + 1`` stream tokens; rank ``dp_rank``
    takes its slice (see the module docstring). The shards' token ids are checked against
    ``min(50257, vocab_size)`` on construction (``TokenStream``). Iteration starts at global batch ``start`` and runs
    for ``num_batches`` batches, or forever (wrapping over epochs) if ``num_batches`` is None.
    With DataLoader workers, worker ``w`` of ``W`` makes batches ``start + w, start + w + W, ...``,
    which the DataLoader returns in order, so the output does not depend on the worker count.
    """

    def __init__(self, paths, batch_size: int, seq_len: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 1337, start: int = 0, num_batches: int | None = None, split: str = "train",
                 vocab_size: int = GPT2_VOCAB):
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be positive, got batch_size={batch_size} seq_len={seq_len}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        self.stream = TokenStream(paths, vocab_size)
        self.batch_size, self.seq_len = batch_size, seq_len
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.start, self.num_batches, self.split = start, num_batches, split
        self.rank_tokens = batch_size * seq_len
        self.span = self.rank_tokens * dp_size  # tokens one global batch advances
        n = len(self.stream)
        if n < self.span + 1:
            raise DataError(
                f"{split} split in {self.stream.paths[0].parent} has {n} tokens, too few for one batch of "
                f"batch_size*seq_len*dp_size+1 = {batch_size}*{seq_len}*{dp_size}+1 = {self.span + 1}: "
                "lower batch_size/seq_len or add data"
            )

    @property
    def batches_per_epoch0(self) -> int:
        """Global batches in epoch 0 (the most any epoch has)."""
        return (len(self.stream) - 1) // self.span

    def epoch_layout(self, epoch: int) -> tuple[TokenStream, int, int]:
        """(stream in this epoch's shard order, first token offset, number of global batches)."""
        if epoch == 0:
            return self.stream, 0, self.batches_per_epoch0
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.stream.paths))
        max_offset = min(self.seq_len, len(self.stream) - 1 - self.span + 1)
        offset = int(rng.integers(max_offset))
        return self.stream.reordered(order), offset, (len(self.stream) - 1 - offset) // self.span

    def batch_at(self, k: int, layout=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Global batch ``k`` (this rank's slice) without iterating; ``layout`` = (epoch, first k of epoch)."""
        epoch, k0 = layout if layout is not None else self._locate(k)
        stream, offset, _ = self.epoch_layout(epoch)
        return self._make(stream, offset + (k - k0) * self.span)

    def _locate(self, k: int) -> tuple[int, int]:
        """(epoch, index of the epoch's first global batch) holding global batch ``k``."""
        epoch, k0 = 0, 0
        while True:
            n = self.epoch_layout(epoch)[2]
            if k < k0 + n or self.num_batches is not None:
                return epoch, k0
            epoch, k0 = epoch + 1, k0 + n

    def _make(self, stream: TokenStream, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = pos + self.dp_rank * self.rank_tokens
        buf = torch.from_numpy(stream.read(lo, lo + self.rank_tokens + 1).astype(np.int64))
        x = buf[:-1].view(self.batch_size, self.seq_len)
        y = buf[1:].view(self.batch_size, self.seq_len)
        return x, y

    def __getstate__(self):
        # the main-process hooks (bound to the data module and its trainer) stay behind in workers
        state = self.__dict__.copy()
        state.pop("start_fn", None)
        state.pop("on_yield", None)
        return state

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        end = math.inf if self.num_batches is None else self.start + self.num_batches
        if self.num_batches is not None and self.start + self.num_batches > self.batches_per_epoch0:
            raise DataError(f"{self.split}: asked for batches up to {end} but the split holds {self.batches_per_epoch0}")
        epoch, k0 = self._locate(self.start)
        stream, offset, n = self.epoch_layout(epoch)
        for k in itertools.count(self.start + wid, nw):
            if k >= end:
                return
            while k >= k0 + n:  # next epoch
                epoch, k0 = epoch + 1, k0 + n
                stream, offset, n = self.epoch_layout(epoch)
            yield self._make(stream, offset + (k - k0) * self.span)


class _ResumableLoader(DataLoader):
    """A DataLoader whose dataset starts, at each ``iter()``, at the position ``dataset.start_fn()``
    gives (read in the main process before workers start), and which counts the batches it returns."""

    def __iter__(self):
        ds = self.dataset
        start_fn = getattr(ds, "start_fn", None)
        if start_fn is not None:
            ds.start = start_fn()
        on_yield = getattr(ds, "on_yield", None)
        for batch in super().__iter__():
            if on_yield is not None:
                on_yield()
            yield batch


# ----------------------------------------------------------------------------------------------
# the data module


class GPTDataModule(L.LightningDataModule):
    """Streams GPT-2 token shards (build-nanogpt format) as (x, y) batches for Lightning.

    Args:
        data_dir: folder of ``*_train_NNNNNN.npy`` / ``*_val_NNNNNN.npy`` shards. A relative path
            missing from the working directory is looked up under the repository root.
        batch_size: micro-batch size B per data-parallel rank.
        seq_len: sequence length T.
        val_batches: batches per validation run (same batches every time); 0 disables validation data.
        seed: fixes the shard order and offset of every epoch after the first.
        num_workers: DataLoader worker processes (0 = load in the training process).
        dp_rank, dp_size: data-parallel rank and size; None = take them from the trainer's strategy
            (``distributed_sampler_kwargs``: the data-parallel mesh for ModelParallelStrategy), or 0 of 1.
        pin_memory: pin batches for faster host-to-GPU copies.

    The training stream is endless (the trainer stops at ``max_steps``). ``state_dict`` records how
    many training batches the training loop has consumed, so a run resumed from a checkpoint
    continues with exactly the next unseen batch.
    """

    def __init__(self, data_dir: str = "data/sample", batch_size: int = 16, seq_len: int = 1024,
                 val_batches: int = 20, seed: int = 1337, num_workers: int = 0,
                 dp_rank: int | None = None, dp_size: int | None = None, pin_memory: bool = False):
        super().__init__()
        if val_batches < 0 or num_workers < 0:
            raise DataError(f"val_batches and num_workers must be >= 0, got {val_batches} and {num_workers}")
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"data.batch_size={batch_size} and data.seq_len={seq_len} must be >= 1")
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.val_batches = val_batches
        self.seed = seed
        self.num_workers = num_workers
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.pin_memory = pin_memory
        self.train_data: TokenBatches | None = None
        self.val_data: TokenBatches | None = None
        self._start = 0  # global train batches consumed before this run (from a checkpoint)
        self._mark = None  # (position, trainer progress) when the train loader last started
        self._yielded = 0  # batches the train loader returned since it last started

    # -- data-parallel placement ----------------------------------------------------------------

    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this process among data-parallel replicas (TP ranks share a rank)."""
        if self.dp_rank is not None or self.dp_size is not None:
            return self.dp_rank or 0, self.dp_size or 1
        return data_parallel_rank_size(getattr(self, "trainer", None))

    # -- Lightning hooks ------------------------------------------------------------------------

    def model_vocab_size(self) -> int:
        """Token ids the attached model can take (its config's ``vocab_used`` or ``vocab_size``); GPT-2's
        50257 when no trainer or model is attached."""
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        config = getattr(module, "config", None)
        return getattr(config, "vocab_used", None) or getattr(config, "vocab_size", None) or GPT2_VOCAB

    def setup(self, stage: str | None = None) -> None:
        """Find and check the shards and build this rank's datasets.

        Every rank opens every shard of the splits it uses, so every rank checks every shard's token ids
        (``check_shard``) here, before any step: a bad id stops all ranks alike, none waits in a collective."""
        rank, size = self.data_parallel()
        vocab = self.model_vocab_size()
        if stage in (None, "fit"):
            self.train_data = TokenBatches(find_shards(self.data_dir, "train"), self.batch_size, self.seq_len,
                                           rank, size, self.seed, split="train", vocab_size=vocab)
            self.train_data.start_fn = self._train_position_at_iter
            self.train_data.on_yield = self._count_yield
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
        return _ResumableLoader(self.train_data, batch_size=None, num_workers=self.num_workers,
                                pin_memory=self.pin_memory)

    def val_dataloader(self) -> DataLoader:
        if self.val_data is None and self.val_batches > 0:
            self.setup("validate")
        if self.val_data is None:
            return []
        return DataLoader(self.val_data, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory)

    # -- position -------------------------------------------------------------------------------

    def _progress(self) -> int | None:
        """Training batches the trainer's loop has processed (ran ``training_step`` on), or None.

        This, not the number of batches the loader produced, is what was consumed: Lightning
        fetches one batch ahead and DataLoader workers run further ahead.
        """
        trainer = getattr(self, "trainer", None)
        try:
            return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)
        except AttributeError:
            return None

    def _train_position_at_iter(self) -> int:
        pos = self.train_position()
        self._mark, self._yielded = (pos, self._progress()), 0
        return pos

    def _count_yield(self) -> None:
        self._yielded += 1

    def train_position(self) -> int:
        """Global training batches consumed so far: the index of the next batch to train on."""
        if self._mark is None:
            return self._start
        pos, progress_then = self._mark
        now = self._progress()
        if progress_then is not None and now is not None:
            return pos + now - progress_then
        return pos + self._yielded  # no trainer: batches returned to the caller

    def state_dict(self) -> dict:
        """Saved in checkpoints by Lightning: the training position and the batch geometry."""
        rank, size = self.data_parallel()
        return {"train_batches": self.train_position(), "batch_size": self.batch_size, "seq_len": self.seq_len,
                "dp_size": size, "seed": self.seed}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at the saved position. If the global batch geometry changed, resume at the first
        batch after the saved token position (with a warning: not an exact continuation)."""
        k = int(state_dict["train_batches"])
        _, size = self.data_parallel()
        old = state_dict["batch_size"] * state_dict["seq_len"] * state_dict["dp_size"]
        new = self.batch_size * self.seq_len * size
        if old != new:
            rank_zero_warn(f"checkpoint data position was saved with {old} tokens per global batch, now {new}: "
                           "resuming at the same token position, not an exact continuation")
            k = -(-k * old // new)
        if state_dict.get("seed", self.seed) != self.seed:
            rank_zero_warn(f"checkpoint data seed {state_dict['seed']} differs from seed {self.seed}: "
                           "later epochs will be ordered differently")
        self._start, self._mark, self._yielded = k, None, 0
