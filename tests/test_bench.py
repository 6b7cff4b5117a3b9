"""The benchmark command on CPU (gloo): what it measures and writes. Nothing here asserts on a timing.

The collectives it records (count and bytes, per mesh dim and kind) must equal gpt_tp.costmodel's hand
derivation, so the bytes the cost model prices are the ones a real step moves.
"""

import json
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT
from gpt_tp.bench import main, parse_layouts
from gpt_tp.parallel import enable_async_tp
from gpt_tp.costmodel import step_collectives
from gpt_tp.model import GPTConfig


def key(rows):
    return sorted((r["dim"], r["kind"], r["group_size"], r["count"], r["bytes"]) for r in rows)


def run_bench(out, *flags):
    cmd = [sys.executable, "-m", "gpt_tp.bench", "--model", "tiny", "--batch-size", "2", "--seq-len", "64",
           "--steps", "2", "--warmup", "1", "--peak-flops", "1e11", "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """bf16 at TP=2 and DP=2 x TP=2 (the markdown / PNG checks), and float32 at TP=2."""
    out = tmp_path_factory.mktemp("bench")
    res, stdout = run_bench(out, "--layouts", "1x2,2x2", "--precision", "bf16-mixed")
    fp32, _ = run_bench(out / "fp32", "--layouts", "1x2", "--precision", "32-true")
    res["runs"] += fp32["runs"]
    return out, res, stdout


def test_outputs(bench):
    out, res, stdout = bench
    runs = res["runs"]
    assert [r["name"] for r in runs] == ["dp1xtp2 bf16-mixed", "dp2xtp2 bf16-mixed", "dp1xtp2 32-true"]
    config = GPTConfig.from_name("tiny")
    for r in runs:
        assert "error" not in r, r
        assert len(r["step_times_s"]) == 2  # warm-up excluded
        s = r["step_time_s"]
        assert s["min"] <= s["median"] <= s["max"]
        assert r["tokens_per_step"] == 2 * 64 * r["dp"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / s["median"])
        assert r["mfu"] == pytest.approx(config.flops_per_token(64) * r["tokens_per_s"] / (1e11 * r["world_size"]))
        assert len(r["peak_memory_bytes"]) == r["world_size"] and min(r["peak_memory_bytes"]) > 10 * 2**20
        assert all(x == x and x > 0 for x in r["loss_first_last"])  # finite losses
    md = (out / "bench.md").read_text()
    assert md.count("\n| dp") == 2 and "TP AG 10x" in md and "DP RS 3x" in md
    assert md in stdout
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 300


def test_collectives_equal_cost_model(bench):
    _, res, _ = bench
    config = GPTConfig.from_name("tiny")
    for r in res["runs"]:
        expected = step_collectives(config, 2, 64, dp=r["dp"], tp=r["tp"], precision=r["precision"])
        assert key(r["collectives"]) == key(expected), r["name"]
        for got in r["collectives"]:  # ring wire bytes: (p-1)/p of the tensor, twice for all-reduce
            assert got["wire_bytes"] == pytest.approx(got["bytes"] * (1.0 if got["kind"] == "all_reduce" else 0.5))


def test_bad_flags(capsys, tmp_path):
    cases = [
        (["--layouts", "1x3"], "tensor_parallel_size=3 must divide model.n_head=4"),
        (["--layouts", "2"], "'2' is not DPxTP"),
        (["--precision", "16-mixed"], "'16-mixed' is not one of 32-true, bf16-mixed"),
        (["--compile", "maybe"], "'maybe' is not on/off"),
        (["--async-tp"], "--async-tp needs CUDA GPUs"),
        (["--gpu", "V100"], "--gpu='V100' is not known"),
        (["--seq-len", "256"], "exceeds the model's block_size=128"),
        (["--model", "gpt5"], "--model='gpt5' is unknown"),
    ]
    for flags, msg in cases:
        assert main(["--model", "tiny", "--seq-len", "64", "--device", "cpu", "--out", str(tmp_path), *flags]) == 2, flags
        assert msg in capsys.readouterr().err, flags
    assert parse_layouts("1x1, 2x4") == [(1, 1), (2, 4)]


def test_async_tp_refused_on_cpu():
    with pytest.raises(RuntimeError, match="async TP needs CUDA GPUs"):
        enable_async_tp(SimpleNamespace(device_type="cpu", size=lambda: 2))


def test_help_and_cpu_scaling_flags():
    proc = subprocess.run([sys.executable, "-m", "gpt_tp.bench", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "--layouts" in proc.stdout and "--peak-flops" in proc.stdout
    proc = subprocess.run([sys.executable, "scripts/bench_cpu_scaling.py", "--seq-len", "255"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--seq-len=255 must be even" in proc.stderr
