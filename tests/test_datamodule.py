"""Tests of gpt_tp.train.datamodule: batches, data-parallel sharding, the bundled sample, resume, memory."""

import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from gpt_tp.data.shards import find_shards, read_shard, shard_name
from gpt_tp.train.datamodule import GPTDataModule, TokenBatches
from shard_files import fake_trainer, make_shards

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# batches


def batch_at(ds: TokenBatches, k: int):
    """Global batch k (this rank's slice), as an iteration started there gives it."""
    ds.start = k
    return next(iter(ds))


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
    assert all(torch.equal(batch_at(ds, k)[0], a[k]) for k in range(30))  # starting at batch k agrees
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
        x1, y1 = batch_at(single, step)
        assert torch.equal(torch.cat(xs), x1) and torch.equal(torch.cat(ys), y1)
    assert GPTDataModule(tmp_path).data_parallel() == (0, 1)  # without a trainer: rank 0 of 1


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
    dm = GPTDataModule(tmp_path, batch_size=2, seq_len=10, val_batches=5)
    dm.trainer = fake_trainer(1, 2)
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


def test_resume_that_keeps_the_tokens_per_step_is_exact(tmp_path):
    """A checkpoint of B=10 x accumulation 1 resumed at B=5 x 2: no warning where the step boundaries line up (the
    same tokens, whole steps), one where they do not; a micro-batch val_check_interval that moves is said."""
    make_shards(tmp_path, [1000, 700])

    def resume(k: int, was: int, now: int, interval=None):
        dm = GPTDataModule(tmp_path, batch_size=5, seq_len=10, val_batches=0)
        dm.trainer = SimpleNamespace(accumulate_grad_batches=now, val_check_interval=interval,
                                     strategy=fake_trainer(0, 1).strategy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.load_state_dict({"train_batches": k, "batch_size": 10, "seq_len": 10, "dp_size": 1, "seed": 1337,
                                "accumulate_grad_batches": was})
        return dm.train_position(), [str(w.message) for w in caught]

    assert resume(4, 1, 2) == (8, [])
    for k, was, now in ((3, 1, 2), (4, 1, 1), (4, None, 2)):  # mid-step; fewer tokens a step; an older checkpoint
        position, messages = resume(k, was, now)
        assert position == 2 * k and len(messages) == 1 and "not an exact continuation" in messages[0]
    assert resume(4, 1, 2, interval=2)[1] == [
        "trainer.val_check_interval=2 counts micro-batches: with trainer.accumulate_grad_batches=2 (was 1) "
        "validation comes every 1 optimizer steps, not every 2; set trainer.val_check_interval=4 to keep the steps it "
        "validates at"]


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
    x, y = batch_at(ds, 24_414)  # tokens [199_999_488, 200_007_680): crosses from shard 1 into shard 2
    end = n - 199_999_488
    assert x.flatten()[end - 5 : end].tolist() == [7] * 5 and int(x.flatten()[end]) == 0
    for k in (0, 12_000, 48_827):  # start, middle, last batch of the epoch
        batch_at(ds, k)
    it = iter(dm.train_dataloader())
    for _ in range(100):
        next(it)
    assert peak_rss_bytes() - before < 64 * 2**20
