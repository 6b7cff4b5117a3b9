"""Tests of gpt_tp.data.prepare (build-nanogpt-identical shards from local jsonl/parquet/txt, resume, bad input) and
of scripts/build_sample.py (the bundled sample's build)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "fixtures"  # hamlet_gut.txt: the opening of Hamlet (see its README)
pytestmark = pytest.mark.usefixtures("tiktoken_cache")  # tiktoken.get_encoding("r50k_base") offline, as the reference

import tiktoken  # noqa: E402

from conftest import one_error_line  # noqa: E402
from gpt_tp.data import prepare as prep  # noqa: E402
from gpt_tp.data.shards import read_shard, write_shard  # noqa: E402
from gpt_tp.errors import DataError  # noqa: E402
from gpt_tp.data.tokenizer import get_encoding  # noqa: E402
from gpt_tp.train.datamodule import GPTDataModule  # noqa: E402
from scripts.build_sample import main as build_sample_main  # noqa: E402


def documents(n=120):
    """Real text: the first ``n`` paragraphs of Hamlet, plus a non-ASCII one and an empty one."""
    paras = [p for p in (CORPUS / "hamlet_gut.txt").read_text().split("\n\n") if p.strip()][:n]
    return paras + ["Façade — naïve “quotes” ☃ 日本語", ""]


def write_jsonl(path: Path, docs, column="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({column: d, "id": len(d)}) + "\n")
    return path


def nanogpt_shards(docs, out: Path, shard_size: int, prefix="edufineweb"):
    """build-nanogpt fineweb.py's shard-writing loop, transcribed (single process)."""
    enc = tiktoken.get_encoding("r50k_base")  # == tiktoken.get_encoding("gpt2")
    eot = enc._special_tokens["<|endoftext|>"]
    shard_index, token_count = 0, 0
    all_tokens_np = np.empty((shard_size,), dtype=np.uint16)
    for doc in docs:
        tokens = np.array([eot] + enc.encode_ordinary(doc)).astype(np.uint16)
        if token_count + len(tokens) < shard_size:
            all_tokens_np[token_count : token_count + len(tokens)] = tokens
            token_count += len(tokens)
        else:
            split = "val" if shard_index == 0 else "train"
            remainder = shard_size - token_count
            all_tokens_np[token_count : token_count + remainder] = tokens[:remainder]
            np.save(out / f"{prefix}_{split}_{shard_index:06d}", all_tokens_np)
            shard_index += 1
            all_tokens_np[0 : len(tokens) - remainder] = tokens[remainder:]
            token_count = len(tokens) - remainder
    if token_count != 0:
        split = "val" if shard_index == 0 else "train"
        np.save(out / f"{prefix}_{split}_{shard_index:06d}", all_tokens_np[:token_count])


def shard_bytes(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.npy"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The documents as jsonl, and build-nanogpt's shards of them (shard size 1000). build-nanogpt would write an
    empty text as a bare <|endoftext|>; prepare skips it, so the reference is made without it."""
    d = tmp_path_factory.mktemp("ref")
    docs = documents()
    write_jsonl(d / "docs.jsonl", docs)
    (d / "nanogpt").mkdir()
    nanogpt_shards([t for t in docs if t], d / "nanogpt", 1000, prefix="docs")  # named as --local names them
    return d, docs


def test_gpt2_encoding_is_r50k_base():
    enc = get_encoding()
    assert enc.eot_token == 50256 and enc.n_vocab == 50257
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's ids


def test_local_jsonl_matches_build_nanogpt_byte_for_byte(tmp_path, reference):
    d, docs = reference
    state = prep.prepare(tmp_path, local=[d / "docs.jsonl"], shard_size=1000, workers=1, progress=False)
    ref = shard_bytes(d / "nanogpt")
    assert len(ref) >= 4 and shard_bytes(tmp_path) == ref
    assert docs[-1] == "" and state["complete"] and state["documents"] == len(docs) - 1  # the empty one skipped
    assert [s["file"] for s in state["shards"]][:2] == ["docs_val_000000.npy", "docs_train_000001.npy"]  # --local names them
    # the stream decodes back to the documents, each preceded by <|endoftext|>
    enc = get_encoding()
    stream = np.concatenate([read_shard(tmp_path / s["file"]) for s in state["shards"]])
    assert state["tokens"] == len(stream) and (stream == 50256).sum() == len(docs) - 1
    assert enc.decode(stream.tolist()) == "".join("<|endoftext|>" + t for t in docs if t)


def test_local_parquet_and_workers(tmp_path, reference):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d, docs = reference
    pq.write_table(pa.table({"body": docs}), tmp_path / "docs.parquet")
    out = tmp_path / "out"
    prep.prepare(out, local=[tmp_path / "docs.parquet"], text_column="body", shard_size=1000, workers=2, progress=False)
    assert shard_bytes(out) == shard_bytes(d / "nanogpt")


def test_local_txt_folder_one_document_per_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    texts = {"b.txt": "Second file.\n\nWith two paragraphs.\n", "a.txt": "First file.\n", "c.txt": "Third."}
    for name, t in texts.items():
        (src / name).write_text(t)
    (src / "notes.md").write_text("ignored: not a data file type")
    with pytest.warns(UserWarning, match="no train shard"):
        state = prep.prepare(tmp_path / "out", local=[src], shard_size=10**6, prefix="t", workers=1, progress=False)
    assert state["documents"] == 3 and [s["file"] for s in state["shards"]] == ["t_val_000000.npy"]
    stream = read_shard(tmp_path / "out" / "t_val_000000.npy")
    want = "".join("<|endoftext|>" + texts[n] for n in sorted(texts))  # sorted file order
    assert get_encoding().decode(stream.tolist()) == want


def test_rerun_skips_complete_shards_and_resumes(tmp_path, reference, monkeypatch):
    d, docs = reference
    out = tmp_path / "out"
    real_write, calls = prep.write_shard, []

    def crash_on_fourth(path, tokens):
        calls.append(Path(path).name)
        if len(calls) == 4:  # dies while writing the 4th shard, after its temporary file exists
            Path(str(path) + ".tmp").write_bytes(b"partial")
            raise KeyboardInterrupt
        real_write(path, tokens)

    monkeypatch.setattr(prep, "write_shard", crash_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(out, local=[d / "docs.jsonl"], shard_size=1000, workers=1, progress=False)
    assert {p.name for p in out.glob("*.npy")} == set(calls[:3])  # no partial shard under a final name
    monkeypatch.setattr(prep, "write_shard", real_write)

    tokenized = []
    real_chunk = prep._tokenize_chunk
    monkeypatch.setattr(prep, "_tokenize_chunk", lambda chunk: tokenized.extend(i for i, _ in chunk) or real_chunk(chunk))
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    state = prep.prepare(out, local=[d / "docs.jsonl"], shard_size=1000, workers=1, progress=False)
    assert shard_bytes(out) == shard_bytes(d / "nanogpt")  # same result as one clean run
    assert all((out / n).stat().st_mtime_ns == t for n, t in before.items())  # complete shards kept
    assert tokenized[0] == state["shards"][2]["next_doc"] > 0  # earlier documents not tokenized again
    tokenized.clear()
    again = prep.prepare(out, local=[d / "docs.jsonl"], shard_size=1000, workers=1, progress=False)
    assert again["complete"] and not tokenized  # complete: nothing to do


def test_cli_help_and_run(tmp_path, reference, capsys):
    d, _ = reference
    with pytest.raises(SystemExit) as e:
        prep.main(["--help"])
    help_text = capsys.readouterr().out
    assert e.value.code == 0 and "--local" in help_text and "--shard-size" in help_text
    prep.main(["--local", str(d / "docs.jsonl"), "--out", str(tmp_path), "--shard-size", "1e3", "--workers", "1", "--quiet"])
    assert shard_bytes(tmp_path) == shard_bytes(d / "nanogpt")
    with pytest.raises(DataError, match=r"--local .*nope.*no such file"):
        prep.main(["--local", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o2"), "--quiet"])
    r = subprocess.run([sys.executable, "-m", "gpt_tp.data.prepare", "--local", str(tmp_path / "nope.jsonl"), "--out",
                        str(tmp_path / "o2")], cwd=REPO, capture_output=True, text=True)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: --local {tmp_path / 'nope.jsonl'}: no such file or folder\n")
    assert not (tmp_path / "o2").exists()


def test_local_prepare_without_out_names_its_folder_for_the_input(tmp_path, reference, monkeypatch):
    d, _ = reference
    monkeypatch.chdir(tmp_path)
    prep.main(["--local", str(d / "docs.jsonl"), "--shard-size", "1e3", "--workers", "1", "--quiet"])
    assert shard_bytes(tmp_path / "docs_shards") == shard_bytes(d / "nanogpt")
    assert not (tmp_path / prep.DEFAULT_OUT).exists()


def test_ctrl_c_is_one_line(tmp_path):
    """SIGINT to prepare's process group (what Ctrl-C sends) while 2 workers tokenize: one line, exit 130."""
    big = tmp_path / "big.txt"
    big.write_text(("To be, or not to be, that is the question. " * 20 + "\n") * 60_000)  # ~50 MB: minutes of work
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "gpt_tp.data.prepare", "--local", str(big), "--out", str(out),
                             "--workers", "2", "--shard-size", "1e5", "--quiet"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("*_train_*.npy")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # tokenizing: its first shards are written
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert (proc.returncode, stdout, stderr) == (130, "", f"interrupted: the complete shards in {out} are kept; run "
                                                          "the same command again to resume\n")


def test_prepared_shards_feed_the_data_module(tmp_path, reference):
    d, _ = reference
    dm = GPTDataModule(d / "nanogpt", batch_size=2, seq_len=32, val_batches=2)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 32) and int(x[0, 0]) == int(read_shard(next((d / "nanogpt").glob("*_train_000001.npy")))[0])


def test_bundled_sample_is_reproducible(tmp_path, command_here):
    """scripts/build_sample.py on the opening of Hamlet gives the same tokens as the bundled sample's Hamlet
    document, with the sample's settings (the whole sample is 42 such documents; the full rebuild needs the 42
    plays, see data/sample/README.md). The build runs as `python scripts/build_sample.py`; its refusal of an empty
    corpus in this process, as the script's __main__ runs it."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "hamlet_gut.txt").write_text((CORPUS / "hamlet_gut.txt").read_text())
    r = subprocess.run([sys.executable, "scripts/build_sample.py", "--corpus", str(tmp_path / "corpus"), "--out",
                        str(tmp_path / "out"), "--quiet"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    built = np.concatenate([read_shard(f) for f in sorted((tmp_path / "out").glob("shakespeare_*.npy"))])
    committed = REPO / "data" / "sample"
    record = json.loads((committed / "shakespeare_prepare.json").read_text())
    stream = np.concatenate([read_shard(committed / s["file"]) for s in record["shards"]])
    starts = np.flatnonzero(stream == 50256)
    assert len(starts) == 42 and built[0] == 50256 and (built == 50256).sum() == 1
    hamlet = [a for a in starts if np.array_equal(stream[a : a + 20], built[:20])]
    assert len(hamlet) == 1 and len(built) > 5000
    # all but the last token (the fixture's final newline; the play goes on with more blank lines)
    assert np.array_equal(stream[hamlet[0] : hamlet[0] + len(built) - 1], built[:-1])
    ours = json.loads((tmp_path / "out" / "shakespeare_prepare.json").read_text())["settings"]
    assert ours.pop("local") == [["hamlet_gut.txt", len((CORPUS / "hamlet_gut.txt").read_bytes())]]
    assert ours == {k: v for k, v in record["settings"].items() if k != "local"}  # shard size, prefix, encoding
    (tmp_path / "empty").mkdir()
    proc = command_here(lambda: build_sample_main(["--corpus", str(tmp_path / "empty"), "--out", str(tmp_path / "out2")]))
    assert re.fullmatch(r"error: --corpus .*empty: no .txt files.*", one_error_line(proc)), proc.stderr


def test_build_sample_keeps_a_built_sample_without_overwrite(tmp_path, command_here):
    """One play into a folder holding the bundled sample: one line, every file unchanged; --overwrite replaces (in
    this process, as the script's __main__ runs it)."""
    out = tmp_path / "sample"
    shutil.copytree(REPO / "data" / "sample", out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "hamlet_gut.txt").write_text((CORPUS / "hamlet_gut.txt").read_text())
    build = ["--corpus", str(tmp_path / "corpus"), "--out", str(out), "--quiet"]
    proc = command_here(lambda: build_sample_main(build))
    assert one_error_line(proc) == (f"error: --out {out} already holds a built sample (17 shakespeare_* files): pass "
                                    "--overwrite to replace them, or give an empty --out")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    proc = command_here(lambda: build_sample_main([*build, "--overwrite"]))
    assert proc.returncode == 0, proc.stderr
    assert sorted(f.name for f in out.glob("shakespeare_*")) == ["shakespeare_prepare.json",
                                                              "shakespeare_val_000000.npy"]


@pytest.mark.parametrize("command, flag, message", [
    ("python -m gpt_tp.data.prepare", "--shard-size=lots", "argument --shard-size: not an integer: 'lots'"),
    ("python scripts/build_sample.py", "--shard-size=lots", "argument --shard-size: invalid int value: 'lots'"),
])
def test_bad_flag_is_one_error_line(command, flag, message, command_here):
    """In this process, as each command's __main__ runs it (test_cli_help_and_run, test_ctrl_c_is_one_line and
    test_bundled_sample_is_reproducible run the commands as processes of their own)."""
    main = build_sample_main if "sample" in command else prep.main
    proc = command_here(lambda: main([flag, *(["--corpus", "x"] if "sample" in command else [])]))
    assert one_error_line(proc) == f"error: {message} (see {command} --help)"


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("raised, pattern", [
    ("notfound", r"--dataset 'nobody/nothing': not found on the Hugging Face Hub"),
    ("offline", r"--dataset 'nobody/nothing': cannot reach the Hugging Face Hub.*--local.*HF_DATASETS_OFFLINE"),
    ("config", r"--config 'nope': no such config of 'nobody/nothing'"),
    ("split", r"--split 'nope': no such split of 'nobody/nothing'"),
])
def test_hub_errors_are_clear(tmp_path, monkeypatch, raised, pattern):
    import datasets

    def fake_load_dataset(path, name=None, split=None, streaming=False, **kw):
        assert streaming
        raise {
            "notfound": datasets.exceptions.DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub"),
            "offline": ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)"),
            "config": ValueError(f"BuilderConfig '{name}' not found. Available: ['default', 'sample-10BT']"),
            "split": ValueError(f"Bad split: {split}. Available splits: ['train']"),
        }[raised]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(DataError, match=pattern):
        prep.prepare(tmp_path / "out", dataset="nobody/nothing", config="nope", split="nope", workers=1, progress=False)
    assert not (tmp_path / "out").exists()  # nothing created on error


def test_error_missing_text_column(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ["a", "b"], column="content")
    with pytest.raises(DataError, match=r"no text column 'text' \(columns: \['content', 'id'\]\); set --text-column"):
        prep.prepare(tmp_path / "o", local=[tmp_path / "d.jsonl"], workers=1, progress=False)
    assert not (tmp_path / "o").exists()  # no empty --out folder left behind


def test_empty_documents_are_skipped(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ["First.", "", "Second.", ""])
    state = prep.prepare(tmp_path / "o", local=[tmp_path / "d.jsonl"], shard_size=4, workers=1, progress=False)
    stream = np.concatenate([read_shard(tmp_path / "o" / s["file"]) for s in state["shards"]])
    assert state["documents"] == 2 and (stream == 50256).sum() == 2  # no bare <|endoftext|> documents
    assert get_encoding().decode(stream.tolist()) == "<|endoftext|>First.<|endoftext|>Second."
    write_jsonl(tmp_path / "e.jsonl", ["", ""])
    with pytest.raises(DataError, match=r"e.jsonl: empty input, no documents \(2 rows, all with empty 'text'\)"):
        prep.prepare(tmp_path / "o2", local=[tmp_path / "e.jsonl"], workers=1, progress=False)


def test_small_corpus_warns_that_there_is_no_train_shard(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = documents(4)
    pq.write_table(pa.table({"text": docs}), tmp_path / "small.parquet")
    n = sum(1 + len(get_encoding().encode_ordinary(t)) for t in docs if t)
    args = ["--local", str(tmp_path / "small.parquet"), "--workers", "1", "--quiet"]
    prep.main([*args, "--out", str(tmp_path / "one")])  # the default --shard-size: 1e8 tokens
    assert sorted(p.name for p in (tmp_path / "one").glob("*.npy")) == ["small_val_000000.npy"]
    with pytest.raises(DataError, match=r"one holds a val shard but no train shards \(prepare's shard 0 is val, the "
                                        r"rest train\): prepare more text .* or a smaller --shard-size"):
        GPTDataModule(tmp_path / "one", batch_size=2, seq_len=8).setup("fit")
    err = capsys.readouterr().err
    assert err == (f"warning: {tmp_path / 'one'}: all {n:,} tokens fit in the val shard (--shard-size 100000000), "
                   f"so there is no train shard to train on: rerun into an empty --out with a --shard-size below {n}, "
                   f"e.g. --shard-size {n // 10} (shard 0 is val, the rest train)\n")
    prep.main([*args, "--out", str(tmp_path / "one")])  # a rerun of the finished folder says it again
    assert "no train shard" in capsys.readouterr().err
    suggested = re.search(r"e\.g\. --shard-size (\S+)", err).group(1)
    prep.main([*args, "--out", str(tmp_path / "ten"), "--shard-size", suggested])  # the advice, as printed, works
    assert len(list((tmp_path / "ten").glob("*_train_*.npy"))) >= 9 and capsys.readouterr().err == ""


def test_error_empty_input(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty.jsonl: empty input"):
        prep.prepare(tmp_path / "o", local=[tmp_path / "empty.jsonl"], workers=1, progress=False)
    (tmp_path / "blank.jsonl").write_text("\n\n")  # a file without a single row
    with pytest.raises(DataError, match=r"blank.jsonl: empty input, no documents"):
        prep.prepare(tmp_path / "o", local=[tmp_path / "blank.jsonl"], workers=1, progress=False)
    assert not list((tmp_path / "o").glob("*.npy"))
    (tmp_path / "nodata").mkdir()
    with pytest.raises(DataError, match=r"--local .*nodata: folder holds no"):
        prep.prepare(tmp_path / "o", local=[tmp_path / "nodata"], workers=1, progress=False)


class FakeEncoding:
    """An encoding with ``n_vocab`` ids whose tokens are the characters' code points (``bad`` is appended to the
    document "bad")."""

    def __init__(self, name, n_vocab, bad):
        self.name, self.n_vocab, self.eot_token, self.bad = name, n_vocab, 50256, bad

    def encode_ordinary(self, text):
        return [ord(c) for c in text] + ([self.bad] if text == "bad" else [])


def test_error_encoding_with_more_ids_than_gpt2(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "get_encoding", lambda name: FakeEncoding(name, 100_277, 100_000))  # like cl100k_base
    write_jsonl(tmp_path / "d.jsonl", ["hi"])
    with pytest.raises(DataError, match=r"--encoding big has 100,277 token ids; shards hold GPT-2 BPE ids \(0..50256\).*"
                                        r"use --encoding r50k_base"):
        prep.prepare(tmp_path / "o", local=[tmp_path / "d.jsonl"], workers=1, encoding="big", progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad", [50257, 50303, 70000])
def test_error_token_id_outside_gpt2_is_never_written(tmp_path, monkeypatch, bad):
    monkeypatch.setattr(prep, "get_encoding", lambda name: FakeEncoding(name, 50257, bad))
    write_jsonl(tmp_path / "d.jsonl", ["good"] * 70 + ["bad", "after"])  # 5 tokens each; tokenized 64 at a time
    with pytest.raises(DataError, match=rf"^--encoding odd, document 70: token id {bad} at position 4 is not a GPT-2 BPE id"):
        prep.prepare(tmp_path / "o", local=[tmp_path / "d.jsonl"], shard_size=100, workers=1, encoding="odd", progress=False)
    written = sorted((tmp_path / "o").glob("*.npy"))
    assert len(written) == 3  # the shards of the first 64 documents are kept ...
    assert max(int(read_shard(f).max()) for f in written) < 50257  # ... and no shard holds the bad id, not even wrapped


@pytest.mark.parametrize("existing", ["bin", "int32", "nanogpt", "prefix", "settings"])
def test_error_out_dir_holds_other_shards(tmp_path, reference, existing):
    d, _ = reference
    out = tmp_path / "out"
    out.mkdir()
    kw = dict(local=[d / "docs.jsonl"], shard_size=1000, workers=1, progress=False, prefix="edufineweb")
    if existing == "bin":  # llm.c's .bin shards
        (out / "edufineweb_train_000001.bin").write_bytes(np.array([20240520, 1, 3, 1, 2, 3], np.int32).tobytes())
        match = r"edufineweb_train_000001.bin, a shard of another format"
    elif existing == "int32":
        np.save(out / "edufineweb_train_000001.npy", np.arange(10, dtype=np.int32))
        match = r"edufineweb_train_000001.npy: expected a 1-D uint16 token array"
    elif existing == "nanogpt":  # build-nanogpt's own output: no record of how it was made
        write_shard(out / "edufineweb_val_000000.npy", np.arange(10))
        match = r"without edufineweb_prepare.json .*use an empty --out"
    elif existing == "prefix":
        write_shard(out / "other_val_000000.npy", np.arange(10))
        match = r"holds shards of prefix 'other', not 'edufineweb'"
    else:
        prep.prepare(out, **kw)
        kw["shard_size"] = 2000
        match = r"other settings \(shard_size differ"
    with pytest.raises(DataError, match=match):
        prep.prepare(out, **kw)


def test_children_see_sigint_as_from_a_terminal():
    """The suite's children receive SIGINT whether pytest ran in a terminal or in a background job that inherited it
    ignored (conftest.pytest_configure): a child that asks for SIGINT's disposition finds Python's handler."""
    script = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    ignored = subprocess.run(["sh", "-c", f"trap '' INT; {sys.executable} -c '{script}'"], capture_output=True, text=True)
    assert ignored.stdout == "False\n"  # the trap reproduces a background job's ignored SIGINT
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert child.stdout == "True\n"
