"""A fresh machine: the repository's files alone in a folder, an empty HOME, no TIKTOKEN_CACHE_DIR, every proxy
pointing at a closed port (no network). The tokenizer round-trips and a short CPU demo trains there; no file of
the repository names a folder outside it; the shipped GPT-2 BPE is tiktoken's r50k_base, token for token."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpt_tp.data import tokenizer

pytestmark = pytest.mark.real_interpreter  # a bare machine's interpreter, not tests/tools/zygote.py's preloaded one

REPO = Path(__file__).resolve().parents[1]
HAMLET = REPO / "tests" / "fixtures" / "hamlet_gut.txt"
NO_NETWORK = "http://127.0.0.1:9"  # the discard port: nothing listens, a request fails at once
# names of a folder outside the repository: a parent's sibling, or the repository root's parent
OUTSIDE = re.compile(r"\.\./+shared|(?:ROOT|REPO)\w*\.parent\b|pwd\)/+shared")


def repo_files() -> list[str]:
    """The files a commit would hold now: tracked ones (with their uncommitted changes) and untracked, not ignored."""
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"not a git work tree ({r.stderr.decode().strip()}): the files of the repository are unknown")
    return [f for f in r.stdout.decode().split("\0") if f and (REPO / f).is_file()]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(copy of the repository, environment of a bare machine); the copy's parent folder holds nothing else."""
    root = tmp_path_factory.mktemp("fresh") / "repo"
    for f in repo_files():
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, root / f)
    home = tmp_path_factory.mktemp("home")
    (home / "tmp").mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TMPDIR": str(home / "tmp"),
           "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           **{k: NO_NETWORK for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY")}}
    assert [p.name for p in root.parent.iterdir()] == ["repo"] and "TIKTOKEN_CACHE_DIR" not in env
    return root, env


def run_in(fresh, *args, timeout=600):
    root, env = fresh
    r = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r


def test_tokenizer_round_trip_on_a_bare_machine(fresh):
    root, env = fresh
    code = ("import json, sys; from gpt_tp.data.tokenizer import RANKS, get_encoding; enc = get_encoding(); "
            "text = open('tests/fixtures/hamlet_gut.txt').read(); ids = enc.encode_ordinary(text); "
            "print(json.dumps({'ranks': str(RANKS), 'hello': enc.encode_ordinary('Hello world'), 'eot': enc.eot_token, "
            "'n_vocab': enc.n_vocab, 'n': len(ids), 'same': enc.decode(ids) == text}))")
    got = json.loads(run_in(fresh, "-c", code).stdout)
    assert Path(got["ranks"]).is_relative_to(root)  # the copy's gpt_tp, not the checkout's
    assert got["hello"] == [15496, 995] and got["eot"] == 50256 and got["n_vocab"] == 50257  # GPT-2's ids
    assert got["same"] and 4000 < got["n"] < len(HAMLET.read_text()) / 2
    assert not (Path(env["TMPDIR"]) / "data-gym-cache").exists()  # tiktoken's default cache was not used


@pytest.mark.slow
def test_demo_trains_on_a_bare_machine(fresh):
    """configs/cpu.yaml (TP=2 over gloo, bundled sample, HellaSwag fixture, text samples) for 10 steps."""
    root, env = fresh
    r = run_in(fresh, "cli.py", "fit", "--config", "configs/cpu.yaml", "--trainer.max_steps", "10",
               "--model.warmup_steps", "2", "--trainer.val_check_interval", "5", "--data.val_batches", "2",
               "--trainer.log_every_n_steps", "1")
    (metrics,) = root.glob("logs/gpt_tp/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    train = [(int(r["step"]), float(r["train/loss"])) for r in rows if r["train/loss"]]
    val = [float(r["val/loss"]) for r in rows if r["val/loss"]]
    hellaswag = [float(r["hellaswag/acc_norm"]) for r in rows if r["hellaswag/acc_norm"]]
    assert [s for s, _ in train] == list(range(10)) and len(val) == 2 and len(hellaswag) == 1
    assert 10.5 < train[0][1] < 11.2  # ln(50257) = 10.8: an untrained model
    assert train[-1][1] < train[0][1] - 1.0 and val[1] < val[0] < train[0][1]
    assert 0 <= hellaswag[0] <= 1
    samples = re.findall(r"step 10 sample \d: Hello, I'm a language model,", r.stdout)
    assert len(samples) == 4, r.stdout[-3000:]  # decoded by the shipped tokenizer
    assert not (Path(env["TMPDIR"]) / "data-gym-cache").exists()


def test_no_file_names_a_folder_outside_the_repository():
    found = []
    for f in repo_files():
        text = (REPO / f).read_bytes().decode("utf-8", "replace")
        found += [f"{f}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}" for m in OUTSIDE.finditer(text)]
    assert not found, "names a folder outside the repository:\n" + "\n".join(found)


def test_shipped_encoding_is_tiktokens_r50k_base(tiktoken_cache):
    """The same 50,257 token byte strings and the same ids on real and tricky text as tiktoken's own loader."""
    import tiktoken

    ours, theirs = tokenizer.get_encoding(), tiktoken.get_encoding("r50k_base")
    assert ours.n_vocab == theirs.n_vocab == 50257 and ours.eot_token == theirs.eot_token == 50256
    assert all(ours.decode_single_token_bytes(i) == theirs.decode_single_token_bytes(i) for i in range(50257))
    text = HAMLET.read_text() + "  \n\n\t x  it's I'LL we've 1234567 Façade — naïve “quotes” ☃ 日本語  \n"
    assert ours.encode_ordinary(text) == theirs.encode_ordinary(text) and len(ours.encode_ordinary(text)) > 4000
    assert ours.encode("<|endoftext|>", allowed_special="all") == [50256]


def test_damaged_ranks_file_is_one_clear_error(tmp_path, monkeypatch):
    from gpt_tp.errors import DataError

    bad = tmp_path / "r50k_base.tiktoken"
    bad.write_bytes(tokenizer.RANKS.read_bytes()[:-10])
    monkeypatch.setattr(tokenizer, "RANKS", bad)
    tokenizer._r50k_base.cache_clear()
    try:
        with pytest.raises(DataError, match=r"r50k_base.tiktoken is missing or damaged \(sha256 is not 306cd27f"):
            tokenizer.get_encoding()
    finally:
        tokenizer._r50k_base.cache_clear()
