"""Token shards in build-nanogpt's format and the stream that reads them (docs/data.md, "Shard format")."""

import copy
import errno
import json
import os
import re
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

from gpt_tp.data.tokenizer import EOT
from gpt_tp.errors import DataError, UserError

GPT2_VOCAB = EOT + 1  # ids GPT-2's BPE produces; a model's vocab_size above it (50304) is padding
SHARD_RE = re.compile(r"^(?P<prefix>.+)_(?P<split>train|val)_(?P<index>\d{6})\.npy$")
_SHARD_LIKE_RE = re.compile(r"^(?P<prefix>.+)_(?P<split>train|val)_(?P<index>\d+)\.[A-Za-z0-9]+$")
REPO_ROOT = Path(__file__).resolve().parents[2]


def check_token_ids(ids, vocab_size: int, where: str) -> None:
    """DataError unless every id in ``ids`` (any array, a CPU tensor too, any shape) is in 0..min(50257, vocab_size)-1,
    naming ``where``, the first bad position, its id and the fix (sought only when the min/max pass fails)."""
    limit, ids = min(GPT2_VOCAB, int(vocab_size)), np.asarray(ids)
    if ids.size == 0:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"{where}: token ids must be integers, got dtype {ids.dtype}")
    lo = 0 if np.issubdtype(ids.dtype, np.unsignedinteger) else int(ids.min())  # a shard's uint16: no min pass
    if lo >= 0 and int(ids.max()) < limit:
        return
    flat = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])  # the first bad id
    pos = tuple(int(i) for i in np.unravel_index(flat, ids.shape)) if ids.ndim > 1 else flat
    value = int(ids.reshape(-1)[flat])
    if value < 0:
        why = "is negative: the data is corrupt; rebuild it with python -m gpt_tp.data.prepare"
    elif value >= GPT2_VOCAB:
        why = (f"is not a GPT-2 BPE id (0..{GPT2_VOCAB - 1}): the data was not tokenized with GPT-2's BPE "
               "(tiktoken r50k_base) or is corrupt; rebuild it with python -m gpt_tp.data.prepare")
    else:
        why = (f"is outside the model's vocabulary (0..{limit - 1}): set model.vocab_size to at least {GPT2_VOCAB} "
               "(e.g. 50304), and model.vocab_used, if set, to 50257")
    raise DataError(f"{where}: token id {value} at position {pos} {why}")


def shard_name(prefix: str, split: str, index: int) -> str:
    return f"{prefix}_{split}_{index:06d}.npy"


def write_shard(path, tokens) -> None:
    """Write ``tokens`` as a uint16 ``.npy`` shard at ``path``, atomically; DataError for an id that does not fit."""
    path, arr = os.fspath(path), np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"{path}: a shard must be a 1-D token array, got shape {arr.shape}")
    if arr.dtype != np.uint16:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"{path}: token ids must be integers, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= 2**16)) if arr.size else []
        if len(bad):
            raise DataError(f"{path}: token id {int(arr[bad[0]])} (at position {int(bad[0])}) does not fit uint16 "
                            "(0..65535); shards hold GPT-2 BPE ids (vocab 50257): use the gpt2/r50k_base encoding")
        arr = arr.astype(np.uint16)
    with atomic_file(path) as f:  # a file object: np.save must not append another ".npy"
        np.save(f, arr)


@contextmanager
def atomic_file(path, unique: bool = False):
    """A binary file that appears at ``path`` only when whole: written beside it (``path + ".tmp"``, or with ``unique``
    a mkstemp name, for several writers), synced, renamed; on failure removed, and an OSError names ``path``."""
    path, tmp = os.fspath(path), None
    try:
        if unique:
            fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                                       dir=os.path.dirname(path) or ".")
            f = os.fdopen(fd, "wb")
        else:
            tmp = path + ".tmp"
            f = open(tmp, "wb")
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if os.fstat(f.fileno()).st_size != f.tell():  # numpy's tofile can come up short on a full disk, silently
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


def make_writable(folder, what: str, flag: str, fix: str) -> None:
    """Create `folder` before any rank starts: not a failure on rank 0 alone while the others wait in a collective."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag}: cannot create {what} {folder} ({e.strerror}); {fix}") from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag}: {what} {folder} is not writable; {fix}")


def shard_header(path) -> tuple[int, int]:
    """(num_tokens, data offset) from the header; DataError unless a 1-D little-endian uint16 .npy of the right size."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            fmt = np.lib.format
            read_header = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            offset = f.tell()
    except (ValueError, OSError, SyntaxError) as e:
        raise DataError(f"{path}: not a readable .npy token shard ({e}); rebuild it with python -m gpt_tp.data.prepare") from e
    if dtype != np.dtype("<u2") or len(shape) != 1 or fortran:
        raise DataError(f"{path}: expected a 1-D uint16 token array (build-nanogpt shard format), got dtype {dtype} "
                        f"shape {shape}; rebuild it with python -m gpt_tp.data.prepare")
    expected, actual = offset + 2 * shape[0], os.path.getsize(path)
    if actual != expected:
        raise DataError(f"{path}: file is {actual} bytes but its header needs {expected}: truncated or corrupt, rebuild it")
    return shape[0], offset


def read_shard(path, mmap: bool = True) -> np.ndarray:
    """Return shard ``path`` as a 1-D uint16 array, memory-mapped read-only unless ``mmap=False``."""
    shard_header(path)
    return np.load(os.fspath(path), mmap_mode="r" if mmap else None, allow_pickle=False)


CHECK_CHUNK = 1 << 22  # tokens (8 MB) mapped at a time while checking a shard
_checked_shards: set = set()  # (file identity, id limit) of the shards checked in this process
MAX_IDS = "shard_max.json"  # beside the shards: {file name: [size, mtime_ns, largest id]}


def check_shard(path, vocab_size: int = GPT2_VOCAB) -> None:
    """``check_token_ids`` over the whole shard ``path``, once per process for each version of the file (recorded_max)."""
    path = os.fspath(path)
    st = os.stat(path)
    limit = min(GPT2_VOCAB, int(vocab_size))
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, limit)
    if key in _checked_shards:
        return
    if recorded_max(path, st) >= limit:
        check_token_ids(read_shard(path), vocab_size, path)  # finds and names the first bad id
    _checked_shards.add(key)


def recorded_max(path: str, st: os.stat_result) -> int:
    """Shard ``path``'s largest id as MAX_IDS records it for this size and mtime, else read and recorded (in a folder
    that cannot be written: read at every start)."""
    record, name, seen = os.path.join(os.path.dirname(path), MAX_IDS), os.path.basename(path), {}
    with suppress(OSError, ValueError, TypeError):  # no record yet, or an unreadable one
        seen = dict(json.loads(Path(record).read_text(encoding="utf-8")))
    if isinstance(entry := seen.get(name), list) and entry[:2] == [st.st_size, st.st_mtime_ns]:
        return int(entry[-1])
    seen[name] = [st.st_size, st.st_mtime_ns, hi := shard_max(path)]
    with suppress(OSError), atomic_file(record, unique=True) as f:  # ranks may record at once: each a whole file
        f.write(json.dumps(seen).encode())
    return hi


def shard_max(path) -> int:
    """The largest token id in shard ``path`` (-1 if empty), read ``CHECK_CHUNK`` tokens at a time (bounded memory)."""
    n, offset = shard_header(path)
    hi = -1
    for lo in range(0, n, CHECK_CHUNK):
        chunk = np.memmap(path, dtype=np.uint16, mode="r", offset=offset + 2 * lo, shape=(min(CHECK_CHUNK, n - lo),))
        hi = max(hi, int(chunk.max()))
        del chunk
    return hi


def resolve_data_dir(data_dir) -> Path:
    """``data_dir``, or a relative one missing here under the repository root (so ``data/sample`` works anywhere)."""
    p = Path(data_dir).expanduser()
    return REPO_ROOT / p if not p.exists() and not p.is_absolute() and (REPO_ROOT / p).exists() else p


def find_shards(data_dir, split: str) -> list[Path]:
    """The shard files of ``split`` in ``data_dir``, in index order (names like build-nanogpt's)."""
    d = resolve_data_dir(data_dir)
    if not d.is_dir():
        raise DataError(f"data directory {os.fspath(data_dir)!r} does not exist (or is not a directory): "
                        "set data_dir to a folder of token shards, e.g. made by python -m gpt_tp.data.prepare")
    found, prefixes = [], set()
    for name in sorted(os.listdir(d)):
        m = SHARD_RE.match(name)
        if m is None:
            m2 = _SHARD_LIKE_RE.match(name)
            if m2 and m2.group("split") == split and not name.endswith((".tmp", ".json", ".md", ".txt")):
                raise DataError(f"{d / name}: looks like a {split} shard but is not a uint16 .npy shard named "
                                f"PREFIX_{split}_NNNNNN.npy (another format, e.g. llm.c .bin?); rebuild with "
                                "python -m gpt_tp.data.prepare")
            continue
        if m.group("split") == split:
            found.append((int(m.group("index")), d / name))
            prefixes.add(m.group("prefix"))
    if not found and split == "train" and any(SHARD_RE.match(n) for n in os.listdir(d)):
        raise DataError(f"{d} holds a val shard but no train shards (prepare's shard 0 is val, the rest train): prepare "
                        "more text into an empty folder, or a smaller --shard-size so that the text makes 2+ shards")
    if not found:
        raise DataError(f"no {split} shards (*_{split}_NNNNNN.npy) in {d}: point data_dir at a folder made by "
                        "python -m gpt_tp.data.prepare or build-nanogpt's fineweb.py")
    if len(prefixes) > 1:
        raise DataError(f"{d}: {split} shards with several prefixes {sorted(prefixes)}: keep one dataset per folder")
    return [p for _, p in sorted(found)]


class TokenStream:
    """Shards read as one token stream. Opening checks every shard (``check_shard``), so a bad one raises DataError
    before any batch; ``read`` maps only the bytes it needs, so memory does not grow with shard size or count."""

    def __init__(self, paths, vocab_size: int = GPT2_VOCAB):
        self.paths = [Path(p) for p in paths]
        self.headers = [shard_header(p) for p in self.paths]  # (num_tokens, data offset) of each shard
        for p in self.paths:
            check_shard(p, vocab_size)
        self.starts = np.cumsum([0] + [n for n, _ in self.headers], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def reordered(self, order) -> "TokenStream":
        """The same shards in another order (headers are not read again)."""
        s = copy.copy(self)
        s.paths, s.headers = [self.paths[i] for i in order], [self.headers[i] for i in order]
        s.starts = np.cumsum([0] + [n for n, _ in s.headers], dtype=np.int64)
        return s

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream as a new uint16 array (may cross shards)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"read [{start}, {stop}) outside stream of {len(self)} tokens")
        out = np.empty(stop - start, dtype=np.uint16)
        i, pos = int(np.searchsorted(self.starts, start, side="right")) - 1, start
        while pos < stop:
            size, offset = self.headers[i]
            lo = pos - int(self.starts[i])
            n = min(stop - pos, size - lo)
            if n > 0:
                out[pos - start : pos - start + n] = np.memmap(self.paths[i], dtype=np.uint16, mode="r",
                                                               offset=offset + 2 * lo, shape=(n,))
            pos, i = pos + n, i + 1
        return out
