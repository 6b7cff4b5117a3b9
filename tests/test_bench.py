"""The benchmark command (python -m benchmarks.bench) on CPU (gloo): what it measures and writes. Nothing here
asserts on a timing.

The collectives it records (count and bytes, per mesh dim and kind) must equal gpt_tp.sizing.sizes' hand
derivation, so the bytes the cost model prices are the ones a real step moves; another plan's (--plan) differ from
it by what that plan does differently.
"""

import json
import re
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT, one_error_line

from benchmarks.bench import launch, main, parse_layouts, parser, specs_from_args
from benchmarks.collectives import step_collectives
from gpt_tp.errors import UserError
from gpt_tp.model import GPTConfig

PLANS = "gpt_tp.parallel:TP_PLAN,benchmarks.plans:overlap2,benchmarks.plans:torch_recipe"


def key(rows):
    return sorted((r["dim"], r["kind"], r["group_size"], r["count"], r["bytes"]) for r in rows)


def run_bench(out, *flags):
    cmd = [sys.executable, "-m", "benchmarks.bench", "--model", "tiny", "--batch-size", "2", "--seq-len", "64",
           "--steps", "2", "--warmup", "1", "--peak-flops", "1e11", "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """bf16 at TP=2 and DP=2 x TP=2 (the markdown / PNG checks), and float32 at TP=2 with gpt_tp's plan and two
    reference plans."""
    out = tmp_path_factory.mktemp("bench")
    res, stdout = run_bench(out, "--layouts", "1x2,2x2", "--precision", "bf16-mixed")
    fp32, _ = run_bench(out / "fp32", "--layouts", "1x2", "--precision", "32-true", "--plan", PLANS)
    res["runs"] += fp32["runs"]
    return out, res, stdout


@pytest.mark.slow
def test_outputs(bench):
    out, res, stdout = bench
    runs = res["runs"]
    assert [r["name"] for r in runs] == [
        "dp1xtp2 bf16-mixed", "dp2xtp2 bf16-mixed", "dp1xtp2 32-true", "dp1xtp2 benchmarks.plans:overlap2 32-true",
        "dp1xtp2 benchmarks.plans:torch_recipe 32-true"]
    assert [r["plan"] for r in runs] == ["gpt_tp.parallel:TP_PLAN"] * 3 + PLANS.split(",")[1:]
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
    tp_ag = sum(c["count"] for c in step_collectives(config, 2, 64, dp=1, tp=2, precision="bf16-mixed")
                if c["dim"] == "tensor_parallel" and c["kind"] == "all_gather")
    assert md.count("\n| dp") == 2 and f"TP AG {tp_ag}x" in md and "DP RS 3x" in md
    assert md in stdout
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 300


@pytest.mark.slow
def test_collectives_equal_cost_model(bench):
    """gpt_tp's plan: the rows of step_collectives, count and bytes. Wire bytes: the ring's."""
    _, res, _ = bench
    config = GPTConfig.from_name("tiny")
    for r in res["runs"]:
        if r["plan"] != "gpt_tp.parallel:TP_PLAN":
            continue
        expected = step_collectives(config, 2, 64, dp=r["dp"], tp=r["tp"], precision=r["precision"])
        assert key(r["collectives"]) == key(expected), r["name"]
        for got in r["collectives"]:  # ring wire bytes: (p-1)/p of the tensor, twice for all-reduce
            p = got["group_size"]
            assert got["wire_bytes"] == pytest.approx(got["bytes"] * (2 if got["kind"] == "all_reduce" else 1) * (p - 1) / p)


@pytest.mark.slow
def test_other_plans_differ_by_what_they_do(bench):
    """--plan runs another plan through the same step; its collectives against gpt_tp's (tiny: L=2 blocks, one
    (B, T, C) float32 activation of 2 x 64 x 64 x 4 bytes):
    overlap2 gathers each MLP input in 2 chunks forward and gathers its output gradient in 2 chunks backward,
    keeping the gathered input (no second gather for the weight gradient): +1 all-gather per block, one activation
    less per block; its 2 chunks reduce-scatter forward and backward: +2 per block, the same bytes.
    torch_recipe leaves the LayerNorm gradients Partial: the step reduces them one parameter each
    (benchmarks.plans.reduce_dtensor_partial_grads), 2 all-reduces per LayerNorm (2L + 1 of them)."""
    _, res, _ = bench
    config = GPTConfig.from_name("tiny")
    L, act = config.n_layer, 2 * 64 * config.n_embd * 4
    ours = {r["kind"]: r for r in step_collectives(config, 2, 64, dp=1, tp=2)}
    runs = {r["plan"].rpartition(":")[2]: {c["kind"]: c for c in r["collectives"]} for r in res["runs"] if r["dp"] == 1}
    overlap, recipe = runs["overlap2"], runs["torch_recipe"]
    assert (overlap["all_gather"]["count"], overlap["all_gather"]["bytes"]) == (
        ours["all_gather"]["count"] + L, ours["all_gather"]["bytes"] - L * act)
    assert (overlap["reduce_scatter"]["count"], overlap["reduce_scatter"]["bytes"]) == (
        ours["reduce_scatter"]["count"] + 2 * L, ours["reduce_scatter"]["bytes"])
    assert overlap["all_reduce"] == ours["all_reduce"]
    assert recipe["all_reduce"]["count"] == ours["all_reduce"]["count"] + 2 * (2 * L + 1)
    for r in res["runs"]:
        assert all(x == x and x > 0 for x in r["loss_first_last"]), r["name"]  # every plan trains


@pytest.mark.slow
def test_bad_flags(tmp_path, command_here):
    cases = [
        (["--layouts", "1x3"], "n_head=4 (every rank holds whole attention heads)"),
        (["--layouts", "2"], "'2' is not DPxTP"),
        (["--precision", "16-mixed"], "'16-mixed' is not one the benchmark step runs: 32-true, 32, bf16-mixed"),
        (["--plan", "overlap2"], "--plan='overlap2' must be module:attribute"),
        (["--plan", "benchmarks.plans:nope"], "module 'benchmarks.plans' has no attribute 'nope'"),
        (["--compile", "maybe"], "'maybe' is not on/off"),
        (["--gpu", "V100"], "--gpu='V100' is not known"),
        (["--seq-len", "256"], "exceeds the model's block_size=128"),
        (["--model", "gpt5"], "--model='gpt5' is unknown"),
    ]
    for flags, msg in cases:
        with pytest.raises(UserError, match=re.escape(msg)):
            main(["--model", "tiny", "--seq-len", "64", "--device", "cpu", "--out", str(tmp_path), *flags])
    assert parse_layouts("1x1, 2x4") == [(1, 1), (2, 4)]
    # as the command's __main__ runs it, in this process (conftest's command_here); the --nope below as processes
    proc = command_here(lambda: main(["--model", "tiny", "--layouts", "2", "--out", str(tmp_path)]))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: --layouts: '2' is not DPxTP (e.g. 1x1 for one device, 1x2 for TP=2, 2x2 for DP=2 x TP=2)"]
    for command in (["benchmarks.bench"], ["benchmarks.bench_worker", "spec.json"]):  # an unknown flag: one line, exit 2
        proc = subprocess.run([sys.executable, "-m", *command, "--nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "unrecognized arguments: --nope" in one_error_line(proc)


def test_default_seq_len_follows_the_model():
    """256 tokens, or the model's block_size when smaller: tiny (block_size 128) runs without --seq-len."""
    specs = specs_from_args(parser().parse_args(["--model", "tiny", "--device", "cpu", "--precision", "32-true"]))
    assert [s["seq_len"] for s in specs] == [128, 128]
    specs = specs_from_args(parser().parse_args(["--model", "gpt2", "--device", "cpu", "--precision", "32-true"]))
    assert [s["seq_len"] for s in specs] == [256, 256]


def _spec(**over):
    args = parser().parse_args(["--model", "tiny", "--layouts", "1x1", "--seq-len", "32", "--batch-size", "1",
                                "--steps", "1", "--warmup", "0", "--device", "cpu", "--precision", "32-true"])
    return {**specs_from_args(args)[0], **over}


@pytest.mark.slow
def test_a_written_result_survives_an_abort_at_exit(tmp_path, monkeypatch):
    """A worker that wrote its result and then aborted while exiting (SIGABRT, as gloo's threads can at interpreter
    shutdown): torchrun fails, and the result is still the result, with torchrun's status noted."""
    hook = tmp_path / "hook"
    hook.mkdir()
    # the worker leaves through gpt_tp.entry's os._exit: make that exit abort instead
    (hook / "sitecustomize.py").write_text("import os\nif 'LOCAL_RANK' in os.environ:\n    os._exit = lambda code: os.abort()\n")
    monkeypatch.setenv("PYTHONPATH", str(hook))
    (tmp_path / "dp1xtp1_32-true.json").write_text('{"stale": true}')  # an earlier bench's file is not taken
    r = launch(_spec(), tmp_path, timeout=300)
    assert "error" not in r and "stale" not in r, r
    assert r["tokens_per_step"] == 32 and len(r["step_times_s"]) == 1
    assert r["exit_note"].startswith("torchrun exited 1 after the result was written") and "SIGABRT" in r["exit_note"]


@pytest.mark.slow
def test_a_failed_worker_reports_its_own_error(tmp_path):
    """A run that fails inside the worker (here: T=32 on a model whose block_size was lowered to 16 behind the
    flag checks) reports the worker's exception, not torchrun's last line containing 'error'."""
    spec = _spec()
    r = launch({**spec, "config": {**spec["config"], "block_size": 16}}, tmp_path, timeout=300)
    assert r["error"] == "rank 0: ValueError: sequence length 32 exceeds model.block_size=16", r["error"]


def test_help(command_here):
    """In this process as its __main__ runs it (the bench fixture runs `python -m benchmarks.bench`)."""
    proc = command_here(lambda: main(["--help"]))
    assert proc.returncode == 0 and "--layouts" in proc.stdout and "--peak-flops" in proc.stdout
    assert "--plan" in proc.stdout and "32-true, 32, bf16-mixed" in proc.stdout


@pytest.mark.slow
def test_loader_command(command_here):
    """python -m benchmarks.loader on the bundled sample: both figures printed; a bad value is one error line (the
    refusals run its main as its __main__ does, in this process: conftest's command_here; they come before the
    command pins its process to one core)."""
    from benchmarks.loader import main as loader_main

    proc = subprocess.run([sys.executable, "-m", "benchmarks.loader", "--seconds", "0.2", "--check-tokens", "1e5",
                           "--batch-size", "4", "--seq-len", "64"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"loader: [\d,.]+M tokens/s on one CPU core \(B=4, T=64, [\d,]+ batches\)", lines[0]), lines
    assert lines[2].startswith("token-id check: ") and "(check_shard, 100,000 tokens)" in lines[2]
    for args, msg in [(["--seconds", "0"], "--seconds=0.0 must be > 0"), (["--nope"], "unrecognized arguments: --nope")]:
        proc = command_here(lambda: loader_main(args))  # noqa: B023
        assert msg in one_error_line(proc)


def test_timing_path_collectives_take_cuda_tensors():
    """The benchmark's timing reduction (benchmarks.step.slowest, bench_worker's and muon_comm's) on fake CUDA tensors
    through --simulate's fake process group, which refuses a collective on a CPU tensor as NCCL does."""
    import torch
    import torch.distributed as dist

    from benchmarks.step import slowest
    from gpt_tp.cli.simulate import CollectiveCounts
    from gpt_tp.torch_internals import FakeTensorMode

    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), CollectiveCounts({dist.group.WORLD.group_name: "world"},
                                                                          "cuda") as comms:
            t = slowest([0.1, 0.2, 0.3], torch.device("cuda"))
            with pytest.raises(RuntimeError, match="on a CPU tensor: NCCL takes tensors on the process group's CUDA"):
                dist.all_reduce(torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64), op=dist.ReduceOp.MAX)
    finally:
        dist.destroy_process_group()
    assert t.device.type == "cuda" and t.dtype == torch.float64 and t.shape == (3,)
    assert comms.counts == {("world", "all_reduce"): 1}
