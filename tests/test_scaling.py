"""gpt_tp.perf.scaling: cli.py fit at TP=2 against TP=1, run for real on the tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_runs_cli_fit_side_by_side_and_pairs_the_ratios(tmp_path):
    """TP=1 and two TP=2 variants, one pair: each ratio is the TP=2 run over the TP=1 run of the same model.malloc
    (@glibc), each run's step time comes from its logged tokens/s, its peak RSS from its processes, and the
    variant reaches the run's config."""
    proc = subprocess.run([sys.executable, "-m", "gpt_tp.perf.scaling", "--model", "tiny", "--batch-size", "2",
                           "--seq-len", "32", "--steps", "3", "--pairs", "1", "--variant", "gpt_tp",
                           "--variant", "gpt_tp:2@glibc", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "scaling.json").read_text())
    runs = res["runs"]
    assert set(runs) == {"tp1", "tp1@glibc", "gpt_tp", "gpt_tp:2@glibc"}
    for name, v in res["variants"].items():
        base, mine = runs["tp1@glibc" if name.endswith("@glibc") else "tp1"][0], runs[name][0]
        assert len(mine["steps_s"]) == 1 and mine["step_s"] > 0  # step 2 of 0..2
        assert v["step_ratio"]["median"] == pytest.approx(mine["step_s"] / base["step_s"])
        assert v["rss_ratio"]["median"] == pytest.approx(mine["peak_rss_mib"] / base["peak_rss_mib"])
    assert all(r[0]["peak_rss_mib"] > 200 for r in runs.values())  # at least a torch process's own memory
    config = json.loads((tmp_path / "pair0" / "gpt_tp_2_glibc" / "config.yaml").read_text())
    assert config["trainer"]["devices"] == 2 and config["model"]["tp_overlap_chunks"] == 2
    assert config["model"]["malloc"] == "glibc"
    assert json.loads((tmp_path / "pair0" / "tp1_glibc" / "config.yaml").read_text())["model"]["malloc"] == "glibc"
    assert json.loads((tmp_path / "pair0" / "gpt_tp" / "config.yaml").read_text())["model"]["malloc"] == "split"
    assert "| gpt_tp:2@glibc |" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--seq-len", "255"], "--seq-len=255 must be even"),
    (["--variant", "gpt_tp:x"], "--variant 'gpt_tp:x': give a plan name"),
    (["--variant", "torch:2"], "--variant 'torch:2': model.tp_overlap_chunks=2 needs model.tp_plan gpt_tp"),
    (["--model", "huge"], "--model='huge': use one of"),
    (["--variant", "gpt_tp@tcmalloc"], "--variant 'gpt_tp@tcmalloc': the suffix is @model.malloc, one of @split, @mmap, @glibc"),
])
def test_bad_flags_are_one_error_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "gpt_tp.perf.scaling", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
