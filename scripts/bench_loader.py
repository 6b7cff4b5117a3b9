"""Measure the training data loader's throughput, and the token-id check of a shard, on one CPU core.

    python scripts/bench_loader.py                       # data/sample, B=64, T=1024 (build-nanogpt's 124M run)
    python scripts/bench_loader.py --data-dir edu_fineweb10B --seconds 20

Prints tokens/s of (x, y) int64 batches through GPTDataModule's DataLoader in the main process
(num_workers=0), pinned to one core with one torch thread, and the ratio to what one GPU consumes
training GPT-2 124M (about 0.5M tokens/s on an H100). A ratio well above 1 means the loader is
never the bottleneck. Then times the token-id check every rank runs once per shard when it opens it
(gpt_tp.data.check_shard), on a --check-tokens uint16 shard of random GPT-2 ids in a temporary folder,
read from the page cache, and check_token_ids on the same tokens as one in-memory array.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gpt_tp.data.shards import GPT2_VOCAB, check_shard, check_token_ids, read_shard, write_shard  # noqa: E402
from gpt_tp.train.datamodule import GPTDataModule

GPU_TOKENS_PER_S = 0.5e6  # GPT-2 124M training on one H100 (build-nanogpt: ~1.5M tok/s on 8x A100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=str(ROOT / "data" / "sample"))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=5.0, help="how long to measure")
    p.add_argument("--check-tokens", type=float, default=100e6, help="tokens in the shard whose check is timed")
    a = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    torch.set_num_threads(1)
    dm = GPTDataModule(a.data_dir, batch_size=a.batch_size, seq_len=a.seq_len, val_batches=0)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    for _ in range(3):  # warm up (page cache, first epoch layout)
        next(it)
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < a.seconds:
        x, y = next(it)
        n += x.numel()
    rate = n / elapsed
    print(f"loader: {rate / 1e6:,.1f}M tokens/s on one CPU core (B={a.batch_size}, T={a.seq_len}, "
          f"{n / (a.batch_size * a.seq_len):,.0f} batches, {len(dm.train_data.stream):,}-token train split)")
    print(f"ratio to one H100 training GPT-2 124M (0.5M tokens/s): {rate / GPU_TOKENS_PER_S:,.0f}x")
    bench_check(int(a.check_tokens))


def bench_check(n: int) -> None:
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


if __name__ == "__main__":
    main()
