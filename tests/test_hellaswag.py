"""HellaSwag: file checks, download, scoring, TP/DP correctness, the Lightning callback and the command line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, one_error_line, read_json, run_torchrun
from gpt_tp.data.shards import DataError
from gpt_tp.data.tokenizer import get_encoding
from gpt_tp.eval import hellaswag as hs
from gpt_tp.eval import hellaswag_data as hd
from gpt_tp.eval import hellaswag_score as score
from gpt_tp.eval.vocab import mask_padded_vocab
from gpt_tp.model import GPT, GPTConfig, hf_config_dict, to_hf_state_dict

FIXTURE = ROOT / "tests" / "fixtures" / "hellaswag_small.jsonl"


@pytest.fixture(scope="module")
def enc():
    return get_encoding()


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(1234)
    return GPT(GPTConfig.from_name("tiny")).eval()


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
    msg = str(e.value)
    assert "4 malformed" in msg
    assert f"{f}:2: missing key(s) 'ctx'" in msg
    assert f"{f}:3: 'endings' must be a list of 4 strings, got 3 endings" in msg
    assert f"{f}:5: 'label' must be an integer 0-3, got 7" in msg
    assert f"{f}:6: invalid JSON" in msg
    assert ":1:" not in msg and ":4:" not in msg and ":7:" not in msg
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
        hd.resolve_path(None, tmp_path)
    assert list(tmp_path.iterdir()) == []

    def broken_write(fd):  # the write fails half-way: the temporary file is removed, dest never appears
        raise OSError("disk full")

    monkeypatch.setattr(hd, "fetch_url", lambda url, timeout=60.0: b"x" * 100)
    monkeypatch.setattr(hd.os, "fsync", broken_write)
    with pytest.raises(OSError, match="disk full"):
        hd.download(tmp_path / hd.FILENAME)
    assert list(tmp_path.iterdir()) == []


# ---- rendering and scoring -----------------------------------------------------------------------------------


def test_render_example_as_build_nanogpt(enc):
    ex = hd.read_examples(FIXTURE)[0]
    rows, masks, label = hd.render_example(ex, enc)
    ctx = enc.encode(ex["ctx"])
    assert label == ex["label"] and len(rows) == 4
    for row, mask, end in zip(rows, masks, ex["endings"]):
        end_tokens = enc.encode(" " + end)
        assert row == ctx + end_tokens
        assert mask == [0] * len(ctx) + [1] * len(end_tokens)


def logits_for(targets: list[list[int]], losses: list[list[float]], T: int, V: int) -> torch.Tensor:
    """(R, T, V) logits whose cross-entropy at position t for target targets[r][t] is losses[r][t]."""
    logits = torch.zeros(len(targets), T, V)
    for r, (tg, ls) in enumerate(zip(targets, losses)):
        for t, (y, loss) in enumerate(zip(tg, ls)):
            p = math.exp(-loss)
            logits[r, t] = math.log((1 - p) / (V - 1))
            logits[r, t, y] = math.log(p)
    return logits


def test_scoring_on_hand_built_logits_acc_vs_acc_norm():
    """Ending 0: one token at loss 1.0 (sum 1.0, mean 1.0). Ending 1: three tokens at 0.5 (sum 1.5, mean 0.5).
    Endings 2, 3: worse on both. acc (lowest sum) picks 0, acc_norm (lowest mean) picks 1."""
    T, V = 5, 16
    tokens = torch.tensor([[7, 2, 0, 0, 0], [7, 3, 4, 5, 0], [7, 6, 6, 0, 0], [7, 8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 0, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    targets = [row[1:].tolist() for row in tokens]  # position t predicts token t + 1
    losses = [[1.0, 9, 9, 9], [0.5, 0.5, 0.5, 9], [2.0, 2.0, 9, 9], [0.9, 0.9, 0.9, 0.9]]
    sum_loss, mean_loss = score.ending_losses(logits_for(targets, losses, T, V), tokens, mask)
    assert sum_loss.tolist() == pytest.approx([1.0, 1.5, 4.0, 3.6], abs=1e-5)  # positions outside the ending ignored
    assert mean_loss.tolist() == pytest.approx([1.0, 0.5, 2.0, 0.9], abs=1e-5)
    assert score.predict(sum_loss, mean_loss) == (0, 1)
    # ids >= vocab_limit leave the softmax: a huge logit there changes nothing once masked
    logits = logits_for(targets, losses, T, V)
    logits[..., 14:] = 50.0
    assert score.ending_losses(logits, tokens, mask)[0][0] > 40  # unmasked, the padded rows dominate
    masked = score.ending_losses(logits, tokens, mask, vocab_limit=14)[0]
    assert masked[0].item() < 1.0  # the mass of (1-p) spread over 15 ids, now 13: loss stays near 1.0
    assert masked.argmin().item() == 0


def test_padded_vocab_masked_whole_or_shard_by_shard():
    """Ids >= limit get -inf, in a whole row or in a vocabulary shard starting at an offset: the shards of a row,
    masked one by one, join into the masked row."""
    logits = torch.randn(2, 3, 16)
    whole = mask_padded_vocab(logits, 13)
    assert torch.isneginf(whole[..., 13:]).all() and torch.equal(whole[..., :13], logits[..., :13])
    shards = [mask_padded_vocab(part, 13, offset=4 * k) for k, part in enumerate(logits.split(4, dim=-1))]
    assert torch.equal(torch.cat(shards, dim=-1), whole)
    assert mask_padded_vocab(logits, None) is logits and mask_padded_vocab(logits, 16) is logits


def test_padding_and_batching_do_not_change_losses(tiny, enc):
    """Right padding (to a TP multiple, or a compile-friendly 64) and batching several examples together leave
    every per-example loss as scored alone (causal attention)."""
    examples = hd.read_examples(FIXTURE)[:5]
    alone = score.evaluate(tiny, examples, block_size=128, batch_size=1, details=True, enc=enc)
    for kw in (dict(batch_size=2, tp=2), dict(batch_size=5, pad_to=64)):
        res = score.evaluate(tiny, examples, block_size=128, details=True, enc=enc, **kw)
        for a, b in zip(alone["examples"], res["examples"]):
            assert a["sum_loss"] == pytest.approx(b["sum_loss"], rel=1e-5)
            assert (a["pred"], a["pred_norm"]) == (b["pred"], b["pred_norm"])
    assert alone["total"] == 5 and alone["correct"] == sum(e["pred"] == e["label"] for e in alone["examples"])
    assert alone["acc_norm"] == sum(e["pred_norm"] == e["label"] for e in alone["examples"]) / 5


def test_long_examples_are_left_truncated(tiny, enc):
    ex = {**hd.read_examples(FIXTURE)[0], "ctx": "The quick brown fox jumps over the lazy dog. " * 30}
    rows, masks, _ = hd.render_example(ex, enc)
    cut_rows, cut_masks, cut = score.fit_rows(rows, masks, 128)
    assert cut and all(len(r) == 128 for r in cut_rows)
    assert all(r[-5:] == full[-5:] and sum(m) == sum(fm) for r, full, m, fm in zip(cut_rows, rows, cut_masks, masks))
    res = score.evaluate(tiny, [ex, hd.read_examples(FIXTURE)[1]], block_size=128, tp=2, enc=enc, details=True)
    assert res["truncated"] == 1 and res["total"] == 2
    assert all(math.isfinite(v) for e in res["examples"] for v in e["sum_loss"])


# ---- tensor and data parallelism (torchrun, gloo) -----------------------------------------------------------


def _dist(tmp_path, nproc, dp, *extra):
    run_torchrun("hellaswag_dist.py", nproc, "--dp", str(dp), "--out", str(tmp_path / "r"), *extra)
    return [read_json(tmp_path / f"r.{rank}.json") for rank in range(nproc)]


def test_tp2_matches_single_device(tmp_path):
    results = _dist(tmp_path, 2, 1)
    for res in results:
        par, ref = res["par"], res["ref"]
        assert par["total"] == ref["total"] == 11
        assert (par["correct"], par["correct_norm"]) == (ref["correct"], ref["correct_norm"])
        assert [e["index"] for e in par["examples"]] == list(range(11))  # TP ranks score every example
        for p, r in zip(par["examples"], ref["examples"]):
            assert p["sum_loss"] == pytest.approx(r["sum_loss"], rel=1e-5)
            assert p["mean_loss"] == pytest.approx(r["mean_loss"], rel=1e-5)
            assert (p["pred"], p["pred_norm"]) == (r["pred"], r["pred_norm"])
        # vocab-sharded logits; the per-token losses only all-reduce (max, sum-exp, target logit), no all-gather
        assert res["logits_type"] == "DTensor"
        assert res["loss_comms"] and all("all_reduce" in k for k in res["loss_comms"]), res["loss_comms"]
    assert results[0]["par"]["examples"] == results[1]["par"]["examples"]


@pytest.mark.parametrize("nproc,dp", [(2, 2), (4, 2)], ids=["dp2", "dp2xtp2"])
def test_dp_covers_every_example_once(tmp_path, nproc, dp):
    """11 examples over 2 DP ranks in batches of 5: rank 0 scores 6, rank 1 scores 5 and runs one padding forward
    (FSDP2 needs the same number of forwards everywhere); the total is 11, not 11 x tp."""
    results = _dist(tmp_path, nproc, dp)
    ref = {e["index"]: e for e in results[0]["ref"]["examples"]}
    seen = {}
    for res in results:
        assert res["par"]["total"] == 11 and res["par_one"]["total"] == 1
        assert (res["par"]["correct"], res["par"]["correct_norm"]) == (results[0]["ref"]["correct"], results[0]["ref"]["correct_norm"])
        idx = [e["index"] for e in res["par"]["examples"]]
        assert idx == list(range(res["dp_rank"], 11, dp))
        seen.setdefault(res["dp_rank"], idx)
        assert seen[res["dp_rank"]] == idx  # the TP ranks of one DP rank score the same examples
        for e in res["par"]["examples"]:
            assert e["sum_loss"] == pytest.approx(ref[e["index"]]["sum_loss"], rel=1e-5)
            assert (e["pred"], e["pred_norm"]) == (ref[e["index"]]["pred"], ref[e["index"]]["pred_norm"])
    covered = sorted(i for idx in seen.values() for i in idx)
    assert covered == list(range(11))  # every example exactly once over the DP ranks
    assert len(seen) == dp


# ---- Lightning ---------------------------------------------------------------------------------------------


def test_callbacks_in_tp2_fit_match_single_device(tmp_path, monkeypatch):
    """Trainer + ModelParallelStrategy(TP=2) + SyntheticDataModule, 4 steps, HellaSwagCallback and
    TextSampleCallback every 2 steps: what they log equals a single-device evaluation of the gathered weights."""
    from gpt_tp.eval.plot import main as plot_main, read_metrics

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
    assert [s for s, _ in metrics["hellaswag/acc_norm"]] == [2, 4]
    assert metrics["hellaswag/acc_norm"][-1][1] == pytest.approx(single["acc_norm"])
    assert "train/loss" in metrics and "val/loss" in metrics
    samples = Path(res["samples_txt"]).read_text().splitlines()
    assert len(samples) == 4 and samples[-1] == f"step 4 sample 1: {res['single_samples'][1]}"
    png = plot_main([str(Path(res["metrics_csv"]).parent), "-o", str(tmp_path / "run.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the command line scores the TP=2 run's distributed checkpoint alone, in one process, the same way
    assert Path(res["ckpt"]).is_dir()
    got = hs.main(["--ckpt_path", res["ckpt"], "--path", str(FIXTURE)])
    assert (got["correct"], got["correct_norm"], got["total"]) == (single["correct"], single["correct_norm"], 11)


# ---- the command line ---------------------------------------------------------------------------------------


def test_cli_hf_dir_and_ckpt_match_in_process(tmp_path, tiny, enc, monkeypatch):
    """--hf-dir (vocab cut to 50257 and padded back with zero rows: the padded-id mask keeps the scores) and
    --ckpt_path (a single-file Lightning checkpoint) score as the in-process model does."""
    from safetensors.torch import save_file

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    examples = hd.read_examples(FIXTURE)
    expected = score.evaluate(tiny, examples, block_size=128, enc=enc)
    hf = tmp_path / "hf"
    hf.mkdir()
    sd = to_hf_state_dict(tiny.state_dict(), tiny.config)
    sd.pop("lm_head.weight")  # tied to wte, as Hugging Face stores GPT-2
    save_file(sd, str(hf / "model.safetensors"))
    cfg = hf_config_dict(tiny.config)
    (hf / "config.json").write_text(json.dumps(cfg))
    got = hs.main(["--hf-dir", str(hf), "--path", str(FIXTURE), "--out", str(tmp_path / "hf.json")])
    assert (got["correct"], got["correct_norm"], got["total"]) == (expected["correct"], expected["correct_norm"], 11)
    assert read_json(tmp_path / "hf.json")["acc_norm"] == expected["acc_norm"]

    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in tiny.state_dict().items()}, "hyper_parameters": {"model": "tiny"}}, ckpt)
    got = hs.main(["--ckpt_path", str(ckpt), "--path", str(FIXTURE), "--batch-size", "2"])
    assert (got["correct"], got["correct_norm"]) == (expected["correct"], expected["correct_norm"])

    (tmp_path / "dcp").mkdir()  # an empty folder is no distributed checkpoint
    with pytest.raises(hd.HellaSwagError, match="dcp"):
        hs.main(["--ckpt_path", str(tmp_path / "dcp"), "--path", str(FIXTURE)])
    with pytest.raises(hd.HellaSwagError, match="not found"):
        hs.main(["--ckpt_path", str(tmp_path / "nope.ckpt"), "--path", str(FIXTURE)])


def test_cli_reports_bad_file_clearly(tmp_path, monkeypatch, capsys):
    from gpt_tp.entry import run

    for k in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 9}\n')
    with pytest.raises(SystemExit) as e:  # what `python -m gpt_tp.eval.hellaswag` runs
        run(lambda: hs.main(["--path", str(bad)]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: 1 malformed") and "Traceback" not in err
    assert f"{bad}:1: 'label' must be an integer 0-3, got 9" in err


def test_cli_bad_flag_is_one_error_line():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "gpt_tp.eval.hellaswag", "--batch-size", "two"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert one_error_line(proc) == ("error: argument --batch-size: invalid int value: 'two' "
                                    "(see python -m gpt_tp.eval.hellaswag --help)")


def test_cli_tp_without_torchrun_says_how_to_launch(user_run):
    line = user_run(lambda: hs.main(["--tp", "2", "--path", str(FIXTURE)]))
    assert line.startswith("error: run this command under torchrun, e.g. python -m torch.distributed.run")


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
