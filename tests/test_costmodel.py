"""The cost model against hand-derived numbers and the measured anchor figures (no timing, pure arithmetic)."""

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, one_error_line

from gpt_tp.hardware import LINKS
from gpt_tp.model import GPTConfig
from gpt_tp.parallel.sizes import counts, step_collectives, wire_bytes
from gpt_tp.perf.costmodel import (ANCHOR, CostModelError, anchor_check, collectives_for, comm_seconds, main,
                                   sizes_markdown, sizes_table, step_time)
from gpt_tp.perf.memory import memory_per_device


def test_ring_wire_bytes():
    assert wire_bytes("all_gather", 1000, 2) == 500
    assert wire_bytes("reduce_scatter", 1000, 4) == 750
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_reduce", 1000, 1) == 0


@pytest.mark.parametrize("n_layer", [2, 12])
def test_sp_counts_are_megatrons(n_layer):
    """Korthikanti et al. 2022, 4.2.2, per step on the TP group: 6L + 3 all-gathers (the column-parallel inputs
    gathered again in backward), 4L + 2 reduce-scatters; 2 all-reduces in the vocab-parallel loss, 1 for the
    sequence-partial gradients, 1 for the grad norm."""
    config = GPTConfig.from_name("tiny", n_layer=n_layer)
    L = n_layer
    assert counts(step_collectives(config, 2, 64, dp=1, tp=2)) == {
        "tensor_parallel": {"all_gather": 6 * L + 3, "reduce_scatter": 4 * L + 2, "all_reduce": 4}}
    assert counts(step_collectives(config, 2, 64, dp=2, tp=2)) == {
        "data_parallel": {"all_gather": 2 * L + 1, "reduce_scatter": L + 1}, "world": {"all_reduce": 1},
        "tensor_parallel": {"all_gather": 6 * L + 3, "reduce_scatter": 4 * L + 2, "all_reduce": 3}}
    for dp, tp in [(1, 2), (2, 2), (2, 1)]:  # the cost model prices gpt_tp's step as it is
        assert collectives_for(config, 2, 64, dp, tp, "bf16-mixed") == step_collectives(config, 2, 64, dp, tp, "bf16-mixed")


def test_sp_bytes_by_hand():
    # GPT-2 124M, B=16, T=1024, fp32, TP=2: every all-gather / reduce-scatter moves one (B, T, C) float32 tensor
    config = GPTConfig.from_name("gpt2")
    act = 16 * 1024 * 768 * 4
    rows = {(c["dim"], c["kind"]): c for c in step_collectives(config, 16, 1024, dp=1, tp=2)}
    assert rows["tensor_parallel", "all_gather"]["bytes"] == 75 * act  # 25 forward, the same 25 again, 25 gradients
    assert rows["tensor_parallel", "reduce_scatter"]["wire_bytes"] == 50 * act / 2
    # bf16: the LayerNorm outputs are cast before their 25 forward gathers (and 25 backward ones) and the c_proj
    # gradients (24 backward gathers) are bf16; only the embedding's gradient gather stays float32
    bf = {(c["dim"], c["kind"]): c for c in step_collectives(config, 16, 1024, dp=1, tp=2, precision="bf16-mixed")}
    assert bf["tensor_parallel", "all_gather"]["bytes"] == 2 * 25 * act // 2 + 24 * act // 2 + act


def test_anchor_figures():
    res = anchor_check()
    pred, meas = res["predicted"], res["measured"]
    assert pred["1 GPU"]["tokens_per_s"] == pytest.approx(meas["1 GPU"])  # the calibration point
    assert res["mfu_1gpu"] == pytest.approx(0.80, abs=0.01)
    # DDP overlaps its 0.5 GB gradient all-reduce with backward: twice one GPU, as measured (132k)
    assert pred["DDP x2"]["tokens_per_s"] == pytest.approx(meas["DDP x2"], rel=0.03)
    # TP's collectives are on the critical path: the model is an upper bound for the naive TP run (70.5k) ...
    naive = pred["TP x2 (naive)"]["tokens_per_s"]
    assert meas["TP x2 (naive)"] < naive < meas["DDP x2"]
    # ... and the rest of the gap is compute lost to splitting (implied efficiency between 0.5 and 1)
    assert 0.5 < res["implied_naive_tp_efficiency"] < 1.0
    # over PCIe TP=2 loses to DP by far, and at the measured efficiency even to one GPU
    assert pred["TP x2 (naive) over PCIe 4"]["tokens_per_s"] < 0.65 * pred["DDP x2 over PCIe 4"]["tokens_per_s"]
    assert pred["TP x2 (naive) over PCIe 4, at that efficiency"]["tokens_per_s"] < meas["1 GPU"]
    assert ANCHOR["link"] in LINKS


def test_where_tp_wins():
    rows = sizes_table()
    by = {(r["model"], r["system"]): r for r in rows}
    for system in {r["system"] for r in rows}:
        shares = [by[m, system]["tp2_comm_share"] for m in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")]
        assert shares == sorted(shares, reverse=True)  # bigger models: TP's communication matters less
        for m in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
            r = by[m, system]
            if r["ddp_fits"]:
                assert r["ddp2_tok_s"] > r["tp2_tok_s"]  # where DP fits it is faster
    # NVLink beats PCIe for TP
    assert by["gpt2", "H100 SXM, NVLink"]["tp2_tok_s"] > 2 * by["gpt2", "H100 PCIe"]["tp2_tok_s"]
    # on 24 GiB 3090s (the planner's memory), from gpt2-medium up DDP does not fit at B=16, TP=2 does up to gpt2-medium
    assert not by["gpt2-medium", "RTX 3090, NVLink bridge"]["ddp_fits"]
    assert by["gpt2-medium", "RTX 3090, NVLink bridge"]["tp2_fits"]
    assert not by["gpt2-large", "RTX 3090, NVLink bridge"]["tp2_fits"]


def test_tp_efficiency_and_bad_input():
    config = GPTConfig.from_name("gpt2")
    kw = dict(config=config, batch_size=16, seq_len=1024, dp=1, tp=2, link=LINKS["pcie4"], peak_flops=71e12, mfu=0.8)
    assert step_time(**kw, tp_efficiency=0.5)["compute_s"] == pytest.approx(2 * step_time(**kw)["compute_s"])
    with pytest.raises(ValueError, match="plan='foo'"):
        collectives_for(config, 1, 8, tp=2, plan="foo")


def test_memory_column_says_what_does_not_fit():
    """Every 'a > b' in the table has a > b, every unmarked figure is within what the GPU may use; the figures are
    the planner's."""
    rows = sizes_table()
    text = sizes_markdown(rows)
    cells = [line.split("|")[-2].strip() for line in text.splitlines() if line.startswith("| gpt2")]
    assert len(cells) == len(rows) == 16
    marked = 0
    for cell, r in zip(cells, rows):
        for part, gb, ok in zip(cell.split(" / "), (r["ddp_mem_gib"], r["tp2_mem_gib"]), (r["ddp_fits"], r["tp2_fits"])):
            m = re.fullmatch(r"([\d.]+)(?: > ([\d.]+))?", part)
            assert m and float(m[1]) == pytest.approx(gb, abs=0.05), (part, gb)
            assert (m[2] is None) == ok, part
            if m[2] is not None:
                marked += 1
                assert float(m[1]) > float(m[2]), part
            else:
                assert float(m[1]) <= r["usable_gib"]
    # gpt2-medium under DDP on a 24 GiB 3090: 28.7 GiB, more than its 95% (22.8)
    medium = memory_per_device(GPTConfig.from_name("gpt2-medium"), 1, 1, 16, 1024, "bf16-mixed").total / 2**30
    assert marked >= 4 and f"{medium:.1f} > 22.8" in text and medium == pytest.approx(28.7, abs=0.05)


def test_cli(capsys, tmp_path):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "| DDP x2 | 132.0k |" in out and "gpt2-xl" in out
    with pytest.raises(CostModelError, match="unknown --link 'nope'"):
        main(["--link", "nope"])
    with pytest.raises(CostModelError, match="--link pcie4 prices the runs of --bench; give --bench"):
        main(["--link", "pcie4"])  # the tables use their own links
    # --bench with --link: the run's collectives priced on that link
    colls = step_collectives(GPTConfig.from_name("tiny"), 2, 64, dp=1, tp=2)  # as a bench.json holds them
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"name": "dp1xtp2 32-true", "collectives": colls, "step_time_s": {"median": 0.05}}]}))
    for link in ("pcie4", "nvlink-h100"):
        assert main(["--bench", str(bench), "--link", link]) == 0
        out = capsys.readouterr().out
        assert f"| dp1xtp2 32-true | {sum(c['wire_bytes'] for c in colls) / 1e6:.1f} | 0.0 | " \
               f"{1e3 * comm_seconds(colls, LINKS[link]):.2f} | 50.0 |" in out and LINKS[link].name in out
    bench.write_text("[]")
    with pytest.raises(CostModelError, match="not a bench.json"):
        main(["--bench", str(bench)])


def test_bad_flag_is_one_error_line():
    proc = subprocess.run([sys.executable, "-m", "gpt_tp.perf.costmodel", "--nope"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "unrecognized arguments: --nope" in one_error_line(proc)
