"""Tests of gpt_tp.data: shard format, batches, data-parallel sharding, resume, memory, bad input."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from gpt_tp.data import shards as data_mod
from gpt_tp.model import GPTConfig
from gpt_tp.data.shards import DataError, TokenStream, check_token_ids, find_shards, read_shard, shard_header, shard_name, write_shard
from gpt_tp.train.datamodule import GPTDataModule, TokenBatches

REPO = Path(__file__).resolve().parent.parent


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
    return types.SimpleNamespace(strategy=types.SimpleNamespace(distributed_sampler_kwargs={"num_replicas": size, "rank": rank}))


# ----------------------------------------------------------------------------------------------
# shard format


def test_round_trip_with_build_nanogpt_format(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, size=1000).astype(np.uint16)
    # build-nanogpt: np.save(filename_without_suffix, uint16 array) -> ".npy" appended
    np.save(tmp_path / "edufineweb_val_000000", tokens)
    write_shard(tmp_path / "ours_val_000000.npy", tokens.astype(np.int64))
    ours, theirs = tmp_path / "ours_val_000000.npy", tmp_path / "edufineweb_val_000000.npy"
    assert ours.read_bytes() == theirs.read_bytes()  # identical files
    assert np.array_equal(read_shard(theirs), tokens)
    assert np.array_equal(np.load(ours), tokens) and np.load(ours).dtype == np.uint16  # build-nanogpt's reader
    assert shard_header(ours)[0] == 1000
    assert not list(tmp_path.glob("*.tmp"))


def test_write_shard_rejects_ids_over_uint16(tmp_path):
    with pytest.raises(DataError, match=r"token id 70000 .*does not fit uint16"):
        write_shard(tmp_path / "x_train_000001.npy", np.array([1, 2, 70000]))
    assert not (tmp_path / "x_train_000001.npy").exists()


def test_find_shards_any_prefix_in_index_order(tmp_path):
    make_shards(tmp_path, [10, 10, 10, 10], prefix="edufineweb")
    assert [p.name for p in find_shards(tmp_path, "train")] == [
        "edufineweb_train_000001.npy", "edufineweb_train_000002.npy", "edufineweb_train_000003.npy"]
    assert [p.name for p in find_shards(tmp_path, "val")] == ["edufineweb_val_000000.npy"]


def test_stream_reads_across_shard_boundaries(tmp_path):
    tokens = make_shards(tmp_path, [7, 5, 3, 11])
    s = TokenStream(find_shards(tmp_path, "val") + find_shards(tmp_path, "train"))
    assert len(s) == 26
    for a, b in [(0, 26), (5, 9), (6, 16), (12, 15), (25, 26), (4, 4)]:
        assert np.array_equal(s.read(a, b), tokens[a:b])


# ----------------------------------------------------------------------------------------------
# batches


def test_batches_shape_dtype_shift_and_crossing(tmp_path):
    make_shards(tmp_path, [100, 37, 50, 41])
    train = np.concatenate([read_shard(p) for p in find_shards(tmp_path, "train")]).astype(np.int64)
    ds = TokenBatches(find_shards(tmp_path, "train"), batch_size=2, seq_len=5, num_batches=None)
    it = iter(ds)
    for k in range(12):  # 12 batches of 10 tokens cross both shard boundaries (37, 87)
        x, y = next(it)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 5)
        want = torch.from_numpy(train[10 * k : 10 * k + 11])
        assert torch.equal(x.flatten(), want[:-1]) and torch.equal(y.flatten(), want[1:])


def test_epochs_wrap_deterministically_by_seed(tmp_path):
    make_shards(tmp_path, [50, 40, 40, 40])
    paths = find_shards(tmp_path, "train")

    def first(seed, n):
        it = iter(TokenBatches(paths, 2, 8, seed=seed))
        return [next(it)[0] for _ in range(n)]

    per_epoch = (120 - 1) // 16  # 7 batches in epoch 0
    a, b, c = first(1, 30), first(1, 30), first(2, 30)
    assert all(torch.equal(u, v) for u, v in zip(a, b))  # same seed, same stream
    assert not all(torch.equal(u, v) for u, v in zip(a[per_epoch:], c[per_epoch:]))  # seed changes later epochs
    assert all(torch.equal(u, v) for u, v in zip(a[:per_epoch], c[:per_epoch]))  # epoch 0 is file order
    ds = TokenBatches(paths, 2, 8, seed=1)
    assert all(torch.equal(ds.batch_at(k)[0], a[k]) for k in range(30))  # random access agrees
    # a later epoch reads every shard: its tokens are a permutation-of-shards window of the data
    seen = torch.cat([x.flatten() for x in a[per_epoch : 2 * per_epoch]])
    assert len(set(seen.tolist())) == len(seen)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_identical_within_tp_group_disjoint_across_dp(tmp_path, dp_size):
    make_shards(tmp_path, [200, 3000, 2000])  # all token values distinct
    B, T, tp, steps = 2, 16, 2, 10
    batches = {}  # (dp_rank, tp_rank) -> list of x
    for dp_rank in range(dp_size):
        for tp_rank in range(tp):  # every rank of a TP group has the same data-parallel rank
            dm = GPTDataModule(tmp_path, batch_size=B, seq_len=T, val_batches=1)
            dm.trainer = fake_trainer(dp_rank, dp_size)  # as ModelParallelStrategy reports it
            dm.setup("fit")
            it = iter(dm.train_dataloader())
            batches[dp_rank, tp_rank] = [next(it) for _ in range(steps)]
    for dp_rank in range(dp_size):
        for (x0, y0), (x1, y1) in zip(batches[dp_rank, 0], batches[dp_rank, 1]):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
    single = TokenBatches(find_shards(tmp_path, "train"), B * dp_size, T)  # one device, B*dp rows
    for step in range(steps):
        xs = [batches[r, 0][step][0] for r in range(dp_size)]
        ys = [batches[r, 0][step][1] for r in range(dp_size)]
        vals = [set(x.flatten().tolist()) for x in xs]
        assert all(not (vals[i] & vals[j]) for i in range(dp_size) for j in range(i + 1, dp_size))
        x1, y1 = single.batch_at(step)
        assert torch.equal(torch.cat(xs), x1) and torch.equal(torch.cat(ys), y1)
    # without a trainer or overrides: rank 0 of 1; explicit dp_rank/dp_size override the trainer
    assert GPTDataModule(tmp_path).data_parallel() == (0, 1)
    dm = GPTDataModule(tmp_path, dp_rank=1, dp_size=dp_size)
    dm.trainer = fake_trainer(0, 1)
    assert dm.data_parallel() == (1, dp_size)


def test_workers_give_the_same_stream(tmp_path):
    make_shards(tmp_path, [200, 900, 700])
    ref = GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=3, num_workers=0)
    par = GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=3, num_workers=2)
    for dm in (ref, par):
        dm.setup("fit")
    a, b = iter(ref.train_dataloader()), iter(par.train_dataloader())
    for _ in range(20):
        assert torch.equal(next(a)[0], next(b)[0])
    va, vb = list(ref.val_dataloader()), list(par.val_dataloader())
    assert len(va) == len(vb) == 3 and all(torch.equal(u[0], v[0]) for u, v in zip(va, vb))


def test_validation_is_fixed_and_sharded(tmp_path):
    tokens = make_shards(tmp_path, [1000, 500])
    dm = GPTDataModule(tmp_path, batch_size=2, seq_len=10, val_batches=5, dp_rank=1, dp_size=2)
    dm.setup("fit")
    v1, v2 = list(dm.val_dataloader()), list(dm.val_dataloader())
    assert len(v1) == 5 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(v1, v2))
    assert torch.equal(v1[0][0].flatten(), torch.from_numpy(tokens[20:40]))  # rank 1's half of batch 0
    dm = GPTDataModule(tmp_path, batch_size=10, seq_len=10, val_batches=20)
    with pytest.warns(UserWarning, match="holds only 9 batches"):
        dm.setup("validate")
    assert len(list(dm.val_dataloader())) == 9


def test_bundled_sample_corpus():
    dm = GPTDataModule("data/sample", batch_size=4, seq_len=64, val_batches=20)
    dm.setup("fit")
    assert len(dm.train_data.stream) > 1_000_000 and len(dm.val_data.stream) == 100_000
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 64) and int(x.max()) < 50257
    assert int(next(iter(dm.val_dataloader()))[0][0, 0]) == 50256  # the val shard starts with a document
    size = sum(p.stat().st_size for p in (REPO / "data" / "sample").iterdir())
    assert size < 5_000_000


# ----------------------------------------------------------------------------------------------
# resume


def test_resume_without_trainer_continues_exactly(tmp_path):
    make_shards(tmp_path, [100, 700, 600])
    ref = GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2)
    ref.setup("fit")
    it = iter(ref.train_dataloader())
    want = [next(it)[0] for _ in range(200)]  # several epochs
    dm = GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    for _ in range(130):
        next(it)
    state = dm.state_dict()
    assert state["train_batches"] == 130
    dm2 = GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2)
    dm2.load_state_dict(state)
    dm2.setup("fit")
    it = iter(dm2.train_dataloader())
    assert all(torch.equal(next(it)[0], want[k]) for k in range(130, 200))


class Recorder(L.LightningModule):
    """Tiny model that records the first token of each row of every training batch it sees."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x[:, 0].tolist())
        return (self.w * x.float().mean()).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(data_dir, max_steps, num_workers=0, ckpt_path=None, callbacks=(), root=None):
    model = Recorder()
    dm = GPTDataModule(data_dir, batch_size=2, seq_len=8, val_batches=2, num_workers=num_workers)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                        val_check_interval=4, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        default_root_dir=root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, trainer


@pytest.mark.parametrize("num_workers", [0, 2])
def test_trainer_resume_continues_with_next_unseen_batch(tmp_path, num_workers):
    data = tmp_path / "data"
    make_shards(data, [100, 300, 200])  # 31 batches per epoch: the run crosses epochs
    full, _ = fit(data, 40, num_workers)
    assert len(full) == 40 and len({tuple(s) for s in full[:31]}) == 31
    # checkpoints saved on_train_batch_end (ModelCheckpoint), while the loader has already run ahead
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=7, save_top_k=-1)
    first, trainer = fit(data, 21, num_workers, callbacks=[ckpt], root=tmp_path)
    assert first == full[:21]
    for step in (7, 14, 21):
        path = next((tmp_path / "ckpt").glob(f"*step={step}.ckpt"))
        assert torch.load(path, weights_only=False)["GPTDataModule"]["train_batches"] == step
        resumed, _ = fit(data, 40, num_workers, ckpt_path=path)
        assert resumed == full[step:40]
    # a checkpoint saved after fit() ends
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    resumed, _ = fit(data, 40, num_workers, ckpt_path=tmp_path / "end.ckpt")
    assert resumed == full[21:40]


@pytest.mark.parametrize("rank", [0, 1])
def test_data_warnings_print_on_rank_zero_only(tmp_path, monkeypatch, rank):
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", rank)
    make_shards(tmp_path, [1000, 700])
    dm = GPTDataModule(tmp_path, batch_size=10, seq_len=10, val_batches=20, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.load_state_dict({"train_batches": 10, "batch_size": 5, "seq_len": 10, "dp_size": 1, "seed": 7})
        dm.setup("fit")  # the val split holds 9 batches of 100, not 20
    assert dm.train_position() == 5  # every rank resumes at the same token position ...
    messages = [str(w.message) for w in caught]
    if rank == 0:  # ... and rank 0 alone says so
        assert len(messages) == 3 and "50 tokens per global batch, now 100" in messages[0]
        assert "seed 7 differs" in messages[1] and "holds only 9 batches" in messages[2]
    else:
        assert messages == []


# ----------------------------------------------------------------------------------------------
# memory


def peak_rss_bytes(reset: bool = False) -> int:
    """This process's peak resident memory (VmHWM), reset to the current RSS first if ``reset``."""
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_large_shard_is_not_read_into_memory(tmp_path):
    n = 200_000_000  # two 400 MB shards (sparse on disk): reading one whole would show in RSS
    for split, idx, size in (("val", 0, 10_000), ("train", 1, n), ("train", 2, n)):
        arr = np.lib.format.open_memmap(tmp_path / shard_name("big", split, idx), mode="w+", dtype=np.uint16, shape=(size,))
        arr[-5:] = 7
        del arr
    dm = GPTDataModule(tmp_path, batch_size=8, seq_len=1024, val_batches=1)
    before = peak_rss_bytes(reset=True)
    dm.setup("fit")  # checks every token id of both shards
    assert len(dm.train_data.stream) == 2 * n
    ds = dm.train_data
    x, y = ds.batch_at(24_414)  # tokens [199_999_488, 200_007_680): crosses from shard 1 into shard 2
    end = n - 199_999_488
    assert x.flatten()[end - 5 : end].tolist() == [7] * 5 and int(x.flatten()[end]) == 0
    for k in (0, 12_000, 48_827):  # start, middle, last batch of the epoch
        ds.batch_at(k)
    it = iter(dm.train_dataloader())
    for _ in range(100):
        next(it)
    assert peak_rss_bytes() - before < 64 * 2**20


# ----------------------------------------------------------------------------------------------
# bad input


def test_error_missing_directory(tmp_path):
    dm = GPTDataModule(tmp_path / "nope")
    with pytest.raises(DataError, match=r"nope.*does not exist"):
        dm.setup("fit")


def test_error_no_shards_for_split(tmp_path):
    write_shard(tmp_path / "x_train_000001.npy", np.arange(5000))
    with pytest.raises(DataError, match=r"no val shards .* in .*test_error_no_shards"):
        GPTDataModule(tmp_path, batch_size=2, seq_len=8).setup("fit")
    GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=0).setup("fit")  # no validation: fine
    with pytest.raises(DataError, match=r"no train shards"):
        GPTDataModule(tmp_path.parent / tmp_path.name / "..", batch_size=2, seq_len=8).setup("fit")


@pytest.mark.parametrize("kind", ["int32", "garbage", "truncated", "2d", "bin"])
def test_error_shard_not_uint16_npy(tmp_path, kind):
    make_shards(tmp_path, [1000, 1000])
    bad = tmp_path / "tiny_train_000002.npy"
    if kind == "int32":
        np.save(bad, np.arange(1000, dtype=np.int32))
    elif kind == "garbage":
        bad.write_bytes(b"this is not numpy")
    elif kind == "truncated":
        write_shard(bad, np.arange(1000))
        bad.write_bytes(bad.read_bytes()[:-10])
    elif kind == "2d":
        np.save(bad, np.zeros((10, 10), dtype=np.uint16))
    else:  # llm.c style .bin shard in the folder
        bad = tmp_path / "tiny_train_000002.bin"
        bad.write_bytes(np.array([20240520, 1, 10], dtype=np.int32).tobytes())
    with pytest.raises(DataError, match=bad.name):
        GPTDataModule(tmp_path, batch_size=2, seq_len=8).setup("fit")


def test_error_split_too_short(tmp_path):
    make_shards(tmp_path, [1000, 16])
    with pytest.raises(DataError, match=r"train split .* has 16 tokens, too few for one batch .* = 17"):
        GPTDataModule(tmp_path, batch_size=2, seq_len=8).setup("fit")
    make_shards(tmp_path, [10, 2000])
    with pytest.raises(DataError, match=r"val split .* has 10 tokens"):
        GPTDataModule(tmp_path, batch_size=2, seq_len=8).setup("fit")


def test_error_mixed_prefixes(tmp_path):
    make_shards(tmp_path, [100, 100], prefix="a")
    make_shards(tmp_path, [100, 100], prefix="b")
    with pytest.raises(DataError, match="several prefixes"):
        GPTDataModule(tmp_path, batch_size=2, seq_len=8).setup("fit")


# ----------------------------------------------------------------------------------------------
# token ids


def put_id(path: Path, position: int, value: int) -> None:
    """Rewrite shard ``path`` with ``value`` at ``position``."""
    tokens = read_shard(path, mmap=False)
    tokens[position] = value
    write_shard(path, tokens)


@pytest.mark.parametrize("value", [50257, 50303, 65535])
def test_check_token_ids_names_where_position_and_id(value):
    ids = np.random.default_rng(0).integers(0, 50257, size=10_000).astype(np.uint16)
    check_token_ids(ids, 50304, "ok.npy")  # every GPT-2 id passes, 50256 included
    check_token_ids(np.array([0, 50256]), 50304, "edges")
    ids[7321], ids[9000] = value, value
    with pytest.raises(DataError, match=rf"^shard.npy: token id {value} at position 7321 is not a GPT-2 BPE id "
                                        r"\(0..50256\).*python -m gpt_tp.data.prepare"):
        check_token_ids(ids, 50304, "shard.npy")
    t = torch.from_numpy(ids.astype(np.int64)).view(100, 100)  # a (B, T) tensor: the position is (row, column)
    with pytest.raises(DataError, match=rf"^prompt: token id {value} at position \(73, 21\)"):
        check_token_ids(t, 50304, "prompt")


def test_check_token_ids_model_vocab_negative_and_dtype():
    ids = torch.tensor([5, 999, 1000, 4])
    check_token_ids(ids[:2], 1000, "small")
    with pytest.raises(DataError, match=r"small: token id 1000 at position 2 is outside the model's vocabulary "
                                        r"\(0..999\): set model.vocab_size to at least 50257"):
        check_token_ids(ids, 1000, "small")
    with pytest.raises(DataError, match=r"neg: token id -1 at position 1 is negative"):
        check_token_ids(np.array([3, -1, 2]), 50304, "neg")
    with pytest.raises(DataError, match=r"f: token ids must be integers"):
        check_token_ids(np.array([1.0]), 50304, "f")
    check_token_ids(torch.zeros(0, dtype=torch.long), 50304, "empty")


@pytest.mark.parametrize("split, value", [("train", 50257), ("train", 60000), ("val", 50303)])
def test_setup_rejects_a_bad_id_in_either_split(tmp_path, split, value):
    make_shards(tmp_path, [2000, 3000, 3000])
    bad = tmp_path / ("tiny_val_000000.npy" if split == "val" else "tiny_train_000002.npy")
    put_id(bad, 1234, value)
    dm = GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2)
    with pytest.raises(DataError, match=rf"{bad.name}: token id {value} at position 1234 is not a GPT-2 BPE id"):
        dm.setup("fit")
    assert dm.train_data is None or split == "val"  # nothing to train on from a bad train split
    if split == "val":
        GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=0).setup("fit")  # val not read: train is fine


def test_setup_checks_against_the_attached_models_vocab(tmp_path):
    make_shards(tmp_path, [2000, 3000])  # ids 0..4999
    trainer = fake_trainer(0, 1)
    dm = GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2)
    for config, ok in [(GPTConfig(vocab_size=5000), True), (GPTConfig(vocab_size=4096), False),
                       (GPTConfig(vocab_size=50304, vocab_used=4000), False), (GPTConfig(vocab_size=50304), True)]:
        trainer.lightning_module = types.SimpleNamespace(config=config)
        dm.trainer = trainer
        if ok:
            dm.setup("fit")
        else:
            limit = config.vocab_used or config.vocab_size
            with pytest.raises(DataError, match=rf"tiny_\w+_00000\d.npy: token id {limit} at position \d+ is outside "
                                                rf"the model's vocabulary \(0..{limit - 1}\)"):
                dm.setup("fit")


def test_each_shard_is_checked_once_never_per_batch(tmp_path, monkeypatch):
    make_shards(tmp_path, [3000, 1000, 1000, 1000])
    reads = []
    real = data_mod.shard_max
    monkeypatch.setattr(data_mod, "shard_max", lambda p: reads.append(Path(p).name) or real(p))
    dm = GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2)
    dm.setup("fit")
    assert sorted(reads) == ["tiny_train_000001.npy", "tiny_train_000002.npy", "tiny_train_000003.npy",
                             "tiny_val_000000.npy"]
    it = iter(dm.train_dataloader())
    for _ in range(400):  # 2.7 epochs over the 3 train shards
        next(it)
    list(dm.val_dataloader())
    dm.setup("validate")  # opened again (as trainer.validate after fit does): not read again
    GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2).setup("fit")
    assert len(reads) == 4
    put_id(tmp_path / "tiny_train_000003.npy", 10, 50300)  # a new version of a file is read again
    with pytest.raises(DataError, match=r"tiny_train_000003.npy: token id 50300 at position 10 "):
        GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2).setup("fit")
    assert reads[4:] == ["tiny_train_000003.npy"]


DATA_FIT = REPO / "tests" / "workers" / "data_fit.py"


def fit_worker(tmp_path, data_dir, nproc: int, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run tests/workers/data_fit.py on ``nproc`` processes under torchrun; return it and the ranks' marks."""
    marks = tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(DATA_FIT),
           "--data-dir", str(data_dir), "--marks", str(marks), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # a hang fails here
    return proc, sorted(p.name for p in marks.iterdir())


def fit_in_process(tmp_path, data_dir) -> list[str]:
    """data_fit.fit at TP=1 in this process; return the marks of ranks that trained."""
    spec = importlib.util.spec_from_file_location("data_fit", DATA_FIT)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        worker.fit(data_dir, marks)
    return sorted(p.name for p in marks.iterdir())


def sample_with_bad_id(tmp_path, split: str, value: int) -> Path:
    """A copy of data/sample with ``value`` at position 54321 of one ``split`` shard; return that shard."""
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "sample", data)
    bad = data / ("shakespeare_val_000000.npy" if split == "val" else "shakespeare_train_000009.npy")
    put_id(bad, 54321, value)
    return bad


def bad_id_message(bad: Path, value: int) -> str:
    return (f"{bad}: token id {value} at position 54321 is not a GPT-2 BPE id (0..50256): the data was not tokenized "
            "with GPT-2's BPE (tiktoken r50k_base) or is corrupt; rebuild it with python -m gpt_tp.data.prepare")


@pytest.mark.parametrize("layout, split, value", [
    ("--tp=2", "train", 60000),  # TP=2 trained to the end on such an id
    ("--dp=2", "val", 50257),  # the first padding id, in the val split, data-parallel ranks reading other rows
])
def test_bad_id_stops_every_rank_before_any_step(tmp_path, layout, split, value):
    bad = sample_with_bad_id(tmp_path, split, value)
    proc, marks = fit_worker(tmp_path, bad.parent, 2, layout)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {bad_id_message(bad, value)}"], out[-4000:]  # once, not once per rank
    assert "DataError" not in out and f'File "{REPO / "gpt_tp"}' not in out, out[-4000:]  # no traceback of ours
    assert marks == []  # no rank started a training step
    # torchrun's summary: every rank exited with the user-error code
    assert proc.returncode != 0 and sorted(re.findall(r"rank\s*: (\d) .*\n\s*exitcode\s*: (\d+)", out)) == [
        ("0", "2"), ("1", "2")], out[-4000:]


def test_bad_id_stops_one_device_before_any_step(tmp_path):
    bad = sample_with_bad_id(tmp_path, "train", 50303)  # the last padding id: trained silently at TP=1
    with pytest.raises(DataError) as e:
        fit_in_process(tmp_path, bad.parent)
    assert str(e.value) == bad_id_message(bad, 50303)
    assert sorted(p.name for p in (tmp_path / "marks").iterdir()) == []
    # the control: the same run on the unmodified sample trains, and leaves its mark
    assert fit_in_process(tmp_path, REPO / "data" / "sample") == ["trained_rank0"]
