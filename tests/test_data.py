"""Tests of gpt_tp.data.shards and the data module's checks: shard format, token ids, bad input (bad shards and ids
stop every rank before any step)."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt_tp.data import shards as data_mod
from gpt_tp.data.shards import TokenStream, check_token_ids, find_shards, read_shard, shard_header, write_shard
from gpt_tp.errors import DataError
from gpt_tp.model import GPTConfig
from gpt_tp.train.datamodule import GPTDataModule
from shard_files import fake_trainer, make_shards, put_id

REPO = Path(__file__).resolve().parent.parent


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


def test_a_shards_largest_id_is_read_once_for_every_start(tmp_path, monkeypatch):
    """Each shard's largest id is recorded beside the shards (shard_max.json), so a later start (a fresh process:
    its memory of checked shards cleared) reads no shard, but one that changed since; in a folder that cannot be
    written every start reads every shard and opens all the same."""
    make_shards(tmp_path, [3000, 1000, 1000, 1000])  # consecutive ids: shard i's largest is its last
    reads, real = [], data_mod.shard_max
    monkeypatch.setattr(data_mod, "shard_max", lambda p: reads.append(Path(p).name) or real(p))

    def start() -> None:
        data_mod._checked_shards.clear()
        GPTDataModule(tmp_path, batch_size=2, seq_len=8, val_batches=2).setup("fit")

    start()
    assert len(reads) == 4
    record = json.loads((tmp_path / data_mod.MAX_IDS).read_text())
    assert {k: v[2] for k, v in record.items()} == {"tiny_val_000000.npy": 2999, "tiny_train_000001.npy": 3999,
                                                    "tiny_train_000002.npy": 4999, "tiny_train_000003.npy": 5999}
    start()
    start()
    assert len(reads) == 4
    put_id(tmp_path / "tiny_train_000003.npy", 10, 50300)
    with pytest.raises(DataError, match=r"tiny_train_000003.npy: token id 50300 at position 10 "):
        start()
    assert reads[4:] == ["tiny_train_000003.npy"]
    put_id(tmp_path / "tiny_train_000003.npy", 10, 7)
    start()
    assert reads[5:] == ["tiny_train_000003.npy"]
    (tmp_path / data_mod.MAX_IDS).unlink()

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(data_mod.tempfile, "mkstemp", read_only)
    start()
    start()
    assert len(reads) == 6 + 8 and not (tmp_path / data_mod.MAX_IDS).exists()


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
@pytest.mark.slow
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
