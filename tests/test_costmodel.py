"""The cost model against hand-derived numbers and the seed user's anchor figures (no timing, pure arithmetic)."""

import pytest

from gpt_tp.perf.audit import megatron_sp_minimum
import json
import re

from gpt_tp.perf.costmodel import (ANCHOR, LINKS, CostModelError, anchor_check, comm_seconds, estimate, main, sizes_markdown,
                              sizes_table, step_collectives, wire_bytes)
from gpt_tp.model import GPTConfig


def test_ring_wire_bytes():
    assert wire_bytes("all_gather", 1000, 2) == 500
    assert wire_bytes("reduce_scatter", 1000, 4) == 750
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_reduce", 1000, 1) == 0


@pytest.mark.parametrize("n_layer", [2, 12])
def test_sp_counts_are_the_megatron_minimum(n_layer):
    config = GPTConfig.from_name("tiny", n_layer=n_layer)
    counts = {c["kind"]: c["count"] for c in step_collectives(config, 2, 64, dp=1, tp=2)}
    assert counts == megatron_sp_minimum(n_layer)


def test_sp_bytes_by_hand():
    # GPT-2 124M, B=16, T=1024, fp32, TP=2: every all-gather / reduce-scatter moves one (B, T, C) float32 tensor
    config = GPTConfig.from_name("gpt2")
    act = 16 * 1024 * 768 * 4
    rows = {(c["dim"], c["kind"]): c for c in step_collectives(config, 16, 1024, dp=1, tp=2)}
    assert rows["tensor_parallel", "all_gather"]["bytes"] == 50 * act
    assert rows["tensor_parallel", "reduce_scatter"]["wire_bytes"] == 50 * act / 2
    # bf16: the LayerNorm outputs are cast before their 25 forward gathers and the c_proj gradients (24 backward
    # gathers) are bf16; only the embedding's gradient gather stays float32
    bf = {(c["dim"], c["kind"]): c for c in step_collectives(config, 16, 1024, dp=1, tp=2, precision="bf16-mixed")}
    assert bf["tensor_parallel", "all_gather"]["bytes"] == 25 * act // 2 + 24 * act // 2 + act


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
    # on 24 GB 3090s, from gpt2-medium up DDP does not fit at B=16, TP=2 does up to gpt2-large
    assert not by["gpt2-medium", "RTX 3090, NVLink bridge"]["ddp_fits"]
    assert by["gpt2-large", "RTX 3090, NVLink bridge"]["tp2_fits"]


def test_tp_efficiency_and_bad_input():
    config = GPTConfig.from_name("gpt2")
    kw = dict(config=config, batch_size=16, seq_len=1024, dp=1, tp=2, link=LINKS["pcie4"], peak_flops=71e12, mfu=0.8)
    assert estimate(**kw, tp_efficiency=0.5)["compute_s"] == pytest.approx(2 * estimate(**kw)["compute_s"])
    with pytest.raises(ValueError, match="plan='foo'"):
        step_collectives(config, 1, 8, tp=2, plan="foo")


def test_memory_column_says_what_does_not_fit():
    """Every 'a > b' in the table has a > b, every unmarked figure is within the GPU's memory (no '24 > 24')."""
    rows = sizes_table()
    text = sizes_markdown(rows)
    cells = [line.split("|")[-2].strip() for line in text.splitlines() if line.startswith("| gpt2")]
    assert len(cells) == len(rows) == 16
    marked = 0
    for cell, r in zip(cells, rows):
        for part, gb, ok in zip(cell.split(" / "), (r["ddp_mem_gb"], r["tp2_mem_gb"]), (r["ddp_fits"], r["tp2_fits"])):
            m = re.fullmatch(r"([\d.]+)(?: > ([\d.]+))?", part)
            assert m and float(m[1]) == pytest.approx(gb, abs=0.05), (part, gb)
            assert (m[2] is None) == ok, part
            if m[2] is not None:
                marked += 1
                assert float(m[1]) > float(m[2]), part
            else:
                assert float(m[1]) <= r["gpu_mem_gb"]
    assert marked >= 4 and "24.3 > 24" in text  # gpt2-medium under DDP on a 24 GB 3090 (24.3 GB)


def test_cli(capsys, tmp_path):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "| DDP x2 | 132.0k |" in out and "gpt2-xl" in out
    with pytest.raises(CostModelError, match="unknown --link 'nope'"):
        main(["--link", "nope"])
    with pytest.raises(CostModelError, match="--link pcie4 prices the runs of --bench; give --bench"):
        main(["--link", "pcie4"])  # was silently ignored: the tables use their own links
    # --bench with --link: the run's collectives priced on that link
    colls = step_collectives(GPTConfig.from_name("tiny"), 2, 64, dp=1, tp=2)
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
