"""Token shards for the data tests: small shard folders, a stand-in trainer, one id rewritten in a shard."""

import types
from pathlib import Path

import numpy as np

from gpt_tp.data.shards import read_shard, shard_name, write_shard


def make_shards(d: Path, sizes, prefix="tiny", start_value=0) -> np.ndarray:
    """Write shards of the given sizes (first is val) holding consecutive token values; return all tokens."""
    d.mkdir(parents=True, exist_ok=True)
    tokens = (np.arange(sum(sizes)) + start_value) % 2**16
    pos = 0
    for i, n in enumerate(sizes):
        write_shard(d / shard_name(prefix, "val" if i == 0 else "train", i), tokens[pos : pos + n])
        pos += n
    return tokens.astype(np.int64)


def fake_trainer(rank, size):
    """A stand-in trainer whose strategy reports data-parallel rank `rank` of `size`, as ModelParallelStrategy does."""
    return types.SimpleNamespace(strategy=types.SimpleNamespace(distributed_sampler_kwargs={"num_replicas": size, "rank": rank}))


def put_id(path: Path, position: int, value: int) -> None:
    """Rewrite shard ``path`` with ``value`` at ``position``."""
    tokens = read_shard(path, mmap=False)
    tokens[position] = value
    write_shard(path, tokens)
