"""HellaSwag: file checks, download, the Lightning callback at TP=2 (scoring and TP/DP: tests/test_hellaswag_score.py)."""

import json
from pathlib import Path

import pytest
import torch

from conftest import ROOT, read_json, run_torchrun
from gpt_tp.checkpoint import load_consolidated
from gpt_tp.errors import DataError
from gpt_tp.eval import hellaswag as hs
from gpt_tp.eval import hellaswag_data as hd
from gpt_tp.eval import hellaswag_score as score
from gpt_tp.model import GPT, GPTConfig

FIXTURE = ROOT / "tests" / "fixtures" / "hellaswag_small.jsonl"


# ---- the file ------------------------------------------------------------------------------------------------


def test_fixture_is_valid_hellaswag():
    examples = hd.read_examples(FIXTURE)
    assert len(examples) == 11
    keys = {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "split", "split_type", "label", "endings", "source_id"}
    assert all(set(e) == keys and e["ctx"] == f"{e['ctx_a']} {e['ctx_b']}" for e in examples)
    assert hd.read_examples(FIXTURE, limit=3) == examples[:3]


def test_malformed_records_reported_with_line_numbers(tmp_path):
    good = FIXTURE.read_text().splitlines()[0]
    rec = json.loads(good)
    lines = [
        good,  # 1
        json.dumps({k: v for k, v in rec.items() if k != "ctx"}),  # 2: missing key
        json.dumps({**rec, "endings": rec["endings"][:3]}),  # 3: three endings
        "",  # 4: blank, skipped
        json.dumps({**rec, "label": 7}),  # 5: label out of range
        '{"ctx": "a man", "endings": [',  # 6: bad JSON
        good,  # 7
    ]
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(hd.HellaSwagError) as e:
        hd.read_examples(f)
    # one line: the first malformed record and the count
    assert str(e.value) == (f"4 malformed HellaSwag record(s) (each needs 'ctx', 4 'endings', 'label' 0-3), the first "
                            f"{f}:2: missing key(s) 'ctx' (and 3 more); fix or delete them, or re-download the file "
                            "(delete it from the cache dir)")
    assert hd.check_record({**rec, "endings": rec["endings"][:3]}) == "'endings' must be a list of 4 strings, got 3 endings"
    assert hd.check_record({**rec, "label": 7}) == "'label' must be an integer 0-3, got 7"
    f.write_text("\n".join([good, *(json.dumps({**rec, "label": "3" * 400}) for _ in range(40))]) + "\n")
    with pytest.raises(hd.HellaSwagError) as e:  # 40 labels of the wrong type: still one short line
        hd.read_examples(f)
    assert len(str(e.value)) - len(str(f)) < 250 and "(and 39 more)" in str(e.value)
    f.write_text(good + "\n" + lines[5] + "\n")
    with pytest.raises(hd.HellaSwagError, match=f"the first {f}:2: invalid JSON"):
        hd.read_examples(f)
    # limit stops before the bad lines
    assert len(hd.read_examples(f, limit=1)) == 1
    with pytest.raises(hd.HellaSwagError, match="not found"):
        hd.read_examples(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(hd.HellaSwagError, match="no HellaSwag records"):
        hd.read_examples(tmp_path / "empty.jsonl")


def test_download_is_atomic_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake_fetch(url, timeout=60.0):
        calls.append(url)
        return FIXTURE.read_bytes()

    monkeypatch.setattr(hd, "fetch_url", fake_fetch)
    cache = tmp_path / "cache"
    path = hd.resolve_path(None, cache)
    assert path == cache / hd.FILENAME and path.read_bytes() == FIXTURE.read_bytes()
    assert calls == [hd.HELLASWAG_URL]
    assert hd.HELLASWAG_URL == "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
    assert sorted(p.name for p in cache.iterdir()) == [hd.FILENAME]  # no temporary file left
    assert hd.resolve_path(None, cache) == path and len(calls) == 1  # cached: not fetched again
    # a local path wins and must exist
    assert hd.resolve_path(FIXTURE, cache) == FIXTURE
    with pytest.raises(hd.HellaSwagError, match="not found"):
        hd.resolve_path(tmp_path / "nope.jsonl", cache)


def test_failed_download_leaves_nothing(tmp_path, monkeypatch):
    def offline(url, timeout=60.0):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(hd, "fetch_url", offline)
    with pytest.raises(hd.HellaSwagError, match="could not download .*Network is unreachable.*copy it to"):
        hd.resolve_path(None, tmp_path / "data" / "hellaswag")
    assert list(tmp_path.iterdir()) == []  # not even an empty cache folder

    def broken_write(fd):  # the write fails half-way: the temporary file is removed, dest never appears
        raise OSError("disk full")

    monkeypatch.setattr(hd, "fetch_url", lambda url, timeout=60.0: b"x" * 100)
    monkeypatch.setattr(hd.os, "fsync", broken_write)
    with pytest.raises(OSError, match="disk full"):
        hd.download(tmp_path / hd.FILENAME)
    assert list(tmp_path.iterdir()) == []


def test_gpu_configs_read_the_file_fetched_with_the_data(tmp_path, monkeypatch, capsys):
    """The GPU configs name data/hellaswag/hellaswag_val.jsonl (no rank downloads it on a compute node), the file
    `python -m gpt_tp.eval.hellaswag_data` writes there."""
    import yaml

    for name in ("tp2", "gpt2-xl-8gpu", "multinode-2x8"):
        callbacks = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["trainer"]["callbacks"]
        (hellaswag,) = [c for c in callbacks if c["class_path"] == "gpt_tp.eval.hellaswag.HellaSwagCallback"]
        assert hellaswag["init_args"]["path"] == "data/hellaswag/hellaswag_val.jsonl", name
    monkeypatch.setattr(hd, "fetch_url", lambda url, timeout=60.0: FIXTURE.read_bytes())
    monkeypatch.chdir(tmp_path)
    hd.main()
    fetched = tmp_path / "data" / "hellaswag" / "hellaswag_val.jsonl"
    assert fetched.read_bytes() == FIXTURE.read_bytes() and capsys.readouterr().out.strip() == "data/hellaswag/hellaswag_val.jsonl"


# ---- Lightning ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_callbacks_in_tp2_fit_match_single_device(tmp_path, monkeypatch):
    """Trainer + ModelParallelStrategy(TP=2) + SyntheticDataModule, 4 steps, HellaSwagCallback and
    TextSampleCallback every 2 steps: what they log equals a single-device evaluation of the gathered weights."""
    from gpt_tp.train.plot import main as plot_main, read_metrics

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run_torchrun("hellaswag_fit.py", 2, "--tp", "2", "--steps", "4", "--out", str(tmp_path / "fit"))
    res = read_json(tmp_path / "fit.json")
    assert res["global_step"] == 4
    single = res["single"]
    assert res["callback_metrics"]["hellaswag/acc_norm"] == pytest.approx(single["acc_norm"], abs=1e-6)
    assert res["callback_metrics"]["hellaswag/acc"] == pytest.approx(single["acc"], abs=1e-6)
    for h in res["histories"]:  # both TP ranks: evaluations at steps 2 and 4 (the end of fit, not twice)
        assert [s for s, _ in h["hs"]] == [2, 4]
        last = h["hs"][-1][1]
        assert (last["total"], last["correct"], last["correct_norm"]) == (11, single["correct"], single["correct_norm"])
        assert [s for s, _ in h["ts"]] == [2, 4]
        assert h["ts"][-1][1] == res["single_samples"]  # same text on every rank, and as on one device
    assert res["histories"][0] == res["histories"][1]
    # logged to the CSV at the optimizer step, and plotted
    metrics = read_metrics(res["metrics_csv"])
    assert [s for s, _ in metrics["hellaswag/acc_norm"]] == [2, 4]  # the steps taken; train and val: the step's index
    assert [s for s, _ in metrics["val/loss"]] == [1, 3] and [s for s, _ in metrics["train/loss"]] == [0, 1, 2, 3]
    assert metrics["hellaswag/acc_norm"][-1][1] == pytest.approx(single["acc_norm"])
    assert "train/loss" in metrics and "val/loss" in metrics
    samples = Path(res["samples_txt"]).read_text().splitlines()
    assert len(samples) == 4 and samples[-1] == f"step 4 sample 1: {res['single_samples'][1]}"
    png = plot_main([str(Path(res["metrics_csv"]).parent), "-o", str(tmp_path / "run.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the TP=2 run's distributed checkpoint, loaded whole in one process, scores the same way
    assert Path(res["ckpt"]).is_dir()
    config, state = load_consolidated(res["ckpt"])
    model = GPT(config).eval()
    model.load_state_dict(state)
    got = score.evaluate(model, hd.read_examples(FIXTURE), block_size=config.block_size)
    assert (got["correct"], got["correct_norm"], got["total"]) == (single["correct"], single["correct_norm"], 11)


def test_token_ids_outside_the_model_vocabulary(tiny, enc):
    """A model whose vocabulary is smaller than the tokenizer's: the first HellaSwag token it has no row for is
    named (example, ending, position, id) before any forward."""
    small = GPT(GPTConfig(**{**vars(tiny.config), "vocab_size": 256})).eval()
    ex = hd.read_examples(FIXTURE)[:2]
    ids = hd.render_example(ex[0], enc)[0][0]
    pos = next(i for i, t in enumerate(ids) if t >= 256)
    with pytest.raises(DataError, match=rf"^HellaSwag example 0, ending 0: token id {ids[pos]} at position {pos} is outside the model's vocabulary \(0..255\)"):
        score.evaluate(small, ex, block_size=128, enc=enc)


def test_callback_arguments_checked():
    with pytest.raises(ValueError, match="every_n_steps=-1"):
        hs.HellaSwagCallback(every_n_steps=-1)
    with pytest.raises(ValueError, match="limit=0"):
        hs.HellaSwagCallback(limit=0)
