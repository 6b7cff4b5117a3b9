"""Measure the training data loader's throughput, and the token-id check of a shard, on one CPU core.

    python -m benchmarks.loader                                  # data/sample, B=64, T=1024 (build-nanogpt's 124M run)
    python -m benchmarks.loader --data-dir edu_fineweb10B --seconds 20

Prints tokens/s of (x, y) int64 batches through GPTDataModule's DataLoader in the main process (num_workers=0),
pinned to one core with one torch thread, and the ratio to what one GPU consumes training GPT-2 124M (about 0.5M
tokens/s on an H100). A ratio well above 1 means the loader is never the bottleneck. Then times the token-id check
every rank runs once per shard when it opens it (gpt_tp.data.shards.check_shard), on a --check-tokens uint16 shard
of random GPT-2 ids in a temporary folder, read from the page cache, and check_token_ids on the same tokens as one
in-memory array.
"""

import os
import tempfile
import time

import numpy as np
import torch

from gpt_tp.data.shards import GPT2_VOCAB, check_shard, check_token_ids, read_shard, write_shard
from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError
from gpt_tp.train.datamodule import GPTDataModule

GPU_TOKENS_PER_S = 0.5e6  # GPT-2 124M training on one H100 (build-nanogpt: ~1.5M tok/s on 8x A100)


def loader_rate(data_dir: str, batch_size: int, seq_len: int, seconds: float) -> None:
    """Tokens/s of the training DataLoader, measured for `seconds` after 3 warm-up batches."""
    dm = GPTDataModule(data_dir, batch_size=batch_size, seq_len=seq_len, val_batches=0)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    for _ in range(3):  # warm up (page cache, first epoch layout)
        next(it)
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        x, _ = next(it)
        n += x.numel()
    rate = n / elapsed
    print(f"loader: {rate / 1e6:,.1f}M tokens/s on one CPU core (B={batch_size}, T={seq_len}, "
          f"{n / (batch_size * seq_len):,.0f} batches)")
    print(f"ratio to one H100 training GPT-2 124M (0.5M tokens/s): {rate / GPU_TOKENS_PER_S:,.0f}x")


def check_rate(n: int) -> None:
    """Time check_shard (chunked memory maps, from the page cache) and check_token_ids on ``n`` tokens."""
    tokens = np.random.default_rng(0).integers(0, GPT2_VOCAB, size=n, dtype=np.uint16)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench_train_000001.npy")
        write_shard(path, tokens)
        read_shard(path, mmap=False)  # into the page cache: time the check, not the disk
        t0 = time.perf_counter()
        check_shard(path)
        shard_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    check_token_ids(tokens, GPT2_VOCAB, "in memory")
    array_s = time.perf_counter() - t0
    per = 1e8 / n
    print(f"token-id check: {shard_s * per:.3f} s per 100M tokens for a shard (check_shard, {n:,} tokens), "
          f"{array_s * per:.3f} s for an in-memory array (check_token_ids), one core")


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m benchmarks.loader", description=__doc__)
    ap.add_argument("--data-dir", default="data/sample", help="a folder of shards (default data/sample)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=5.0, help="how long to measure the loader (default 5)")
    ap.add_argument("--check-tokens", type=float, default=100e6, help="tokens in the shard whose check is timed")
    a = ap.parse_args(argv)
    if not a.seconds > 0 or not a.check_tokens >= 1:
        raise UserError(f"--seconds={a.seconds} must be > 0 and --check-tokens={a.check_tokens:g} >= 1")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    torch.set_num_threads(1)
    loader_rate(a.data_dir, a.batch_size, a.seq_len, a.seconds)
    check_rate(int(a.check_tokens))


if __name__ == "__main__":
    run(main)
