"""HellaSwag scoring: rendering, per-ending losses on hand-built logits, the padded-vocabulary mask, padding and
truncation, and TP/DP scoring on real processes against one device."""

import math

import pytest
import torch

from conftest import ROOT, read_json, run_torchrun
from gpt_tp.eval import hellaswag_data as hd
from gpt_tp.eval import hellaswag_score as score
from gpt_tp.parallel.loss import mask_padded_vocab
from gpt_tp.ranks import Layout

FIXTURE = ROOT / "tests" / "fixtures" / "hellaswag_small.jsonl"


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
    assert (sum_loss.argmin(), mean_loss.argmin()) == (0, 1)  # evaluate's acc and acc_norm picks
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
    for kw in (dict(batch_size=2, layout=Layout(1, 2)), dict(batch_size=5, pad_to=64)):
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
    res = score.evaluate(tiny, [ex, hd.read_examples(FIXTURE)[1]], block_size=128, layout=Layout(1, 2), enc=enc,
                         details=True)
    assert res["truncated"] == 1 and res["total"] == 2
    assert all(math.isfinite(v) for e in res["examples"] for v in e["sum_loss"])


# ---- tensor and data parallelism (torchrun, gloo) -----------------------------------------------------------


def _dist(tmp_path, nproc, dp, *extra):
    run_torchrun("hellaswag_dist.py", nproc, "--dp", str(dp), "--out", str(tmp_path / "r"), *extra)
    return [read_json(tmp_path / f"r.{rank}.json") for rank in range(nproc)]


@pytest.mark.slow
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
@pytest.mark.slow
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
