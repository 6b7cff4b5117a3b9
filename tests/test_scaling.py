"""benchmarks/scaling.py: cli.py fit at TP=2 against TP=1, run for real on the tiny model."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.real_interpreter  # peak RSS of fresh processes (a zygote child carries the server's preloaded pages)
def test_runs_cli_fit_side_by_side_and_pairs_the_ratios(tmp_path):
    """TP=1 and two TP=2 variants, one pair: each ratio is the TP=2 run over the TP=1 run of the same allocator
    (@glibc), each run's step time comes from its logged tokens/s, its peak RSS from its processes, and the
    allocator reaches the run's config (HeapSplit listed or not); a plan variant runs through benchmarks.fit."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--model", "tiny", "--batch-size", "2",
                           "--seq-len", "32", "--steps", "3", "--pairs", "1", "--variant", "gpt_tp",
                           "--variant", "benchmarks.plans:overlap2@glibc", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "scaling.json").read_text())
    runs = res["runs"]
    assert set(runs) == {"tp1", "tp1@glibc", "gpt_tp", "benchmarks.plans:overlap2@glibc"}
    for name, v in res["variants"].items():
        base, mine = runs["tp1@glibc" if name.endswith("@glibc") else "tp1"][0], runs[name][0]
        assert len(mine["steps_s"]) == 1 and mine["step_s"] > 0  # step 2 of 0..2
        assert v["step_ratio"]["median"] == pytest.approx(mine["step_s"] / base["step_s"])
        assert v["rss_ratio"]["median"] == pytest.approx(mine["peak_rss_mib"] / base["peak_rss_mib"])
    assert all(r[0]["peak_rss_mib"] > 200 for r in runs.values())  # at least a torch process's own memory
    callbacks = lambda run: json.loads((tmp_path / "pair0" / run / "config.yaml").read_text())["trainer"]["callbacks"]  # noqa: E731
    config = json.loads((tmp_path / "pair0" / "benchmarks_plans_overlap2_glibc" / "config.yaml").read_text())
    assert config["trainer"]["devices"] == 2
    assert callbacks("benchmarks_plans_overlap2_glibc") == [] and callbacks("tp1_glibc") == []
    heap_split = [{"class_path": "gpt_tp.train.malloc.HeapSplit", "init_args": {"policy": "split"}}]
    assert callbacks("gpt_tp") == heap_split and callbacks("tp1") == heap_split
    assert "| benchmarks.plans:overlap2@glibc |" in proc.stdout


def refused(command_here, module: str, args: list[str], process: bool):
    """`python -m <module> ARGS`: a real process, or (process False) its main as its __main__ runs it, in this process
    (conftest's command_here: the same exit code and output, without a process's start-up)."""
    if process:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True)
    main = importlib.import_module(module).main
    return command_here(lambda: main(args))


@pytest.mark.parametrize("args,message,process", [
    (["--seq-len", "255"], "--seq-len=255 must be even", True),
    (["--variant", "torch"], "--variant 'torch': --plan='torch' must be module:attribute", False),
    (["--variant", "benchmarks.plans:nope"], "--variant 'benchmarks.plans:nope': --plan='benchmarks.plans:nope': module", False),
    (["--model", "huge"], "--model='huge': use one of", False),
    (["--variant", "gpt_tp@tcmalloc"], "--variant 'gpt_tp@tcmalloc': the suffix is the allocator, one of @split, @mmap, @glibc", False),
])
@pytest.mark.slow
def test_bad_flags_are_one_error_line(command_here, args, message, process):
    proc = refused(command_here, "benchmarks.scaling", args, process)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("args,message,process", [
    ([], "usage: python -m benchmarks.fit --plan module:attribute fit --config", True),
    (["--plan", "ordered", "fit"], "--plan='ordered' must be module:attribute, e.g. benchmarks.plans:ordered", False),
    (["--plan", "benchmarks.plans:nope", "fit"], "--plan='benchmarks.plans:nope': module 'benchmarks.plans' has no attribute 'nope'", False),
    (["--plan", "benchmarks.plans:overlap_plan", "fit"], "--plan='benchmarks.plans:overlap_plan' is neither a plan dict nor a GPTModule subclass", False),
])
def test_fit_with_a_plan_refuses_a_bad_plan_in_one_line(command_here, args, message, process):
    """python -m benchmarks.fit: a missing or wrong --plan is one error line, exit 2, before cli.py parses anything."""
    proc = refused(command_here, "benchmarks.fit", args, process)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
