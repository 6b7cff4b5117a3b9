"""scripts/gpu_check.sh --dry-run on any machine: its stages in order, each through the .venv python, their limits
adding up (by the script's own arithmetic) to at most 9 minutes on 1 and on 2 GPUs, a result file per stage, the
closing table, a failed stage's exit code, no stale result; and the fit stages' configs are ones cli.py reads."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT

STAGES = ["gpu-tests", "fit", "resume", "validate", "bench"]


def dry_run(out, ngpu: int, **env):
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "OUT": str(out), "NGPU": str(ngpu), **env})


@pytest.mark.parametrize("ngpu,tp,seconds", [(1, 1, 445), (2, 2, 485)])  # docs/scale.md, "First GPU run"
def test_stages_limits_results_and_table(tmp_path, ngpu, tp, seconds):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".gpu_check").touch()
    (out / "bench.json").write_text("an earlier check's")  # stale: removed, never reported
    proc = dry_run(out, ngpu)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    arithmetic = re.fullmatch(rf"gpu_check: {ngpu} GPU\(s\), TP={tp}; limits: setup (\d+)((?: \+ [\w-]+ \d+\+\d+)+) = "
                              r"(\d+) s of 540", lines[0])
    parts = re.findall(r"\+ ([\w-]+) (\d+)\+(\d+)", arithmetic[2])
    assert [p[0] for p in parts] == STAGES
    total = int(arithmetic[1]) + sum(int(limit) + int(kill) for _, limit, kill in parts)
    assert total == int(arithmetic[3]) == seconds <= 540
    runs = [re.fullmatch(r"gpu_check: ([\w-]+) \(limit (\d+) s\): (.*)", line) for line in lines[1:6]]
    assert [(m[1], m[2]) for m in runs] == [(name, limit) for name, limit, _ in parts]
    assert all(m[3].startswith(".venv/bin/python ") for m in runs)
    commands = {m[1]: m[3] for m in runs}
    assert commands["gpu-tests"] == ".venv/bin/python -m pytest -q -m gpu tests/test_gpu.py"
    assert commands["fit"].startswith(".venv/bin/python cli.py fit --config configs/tp2.yaml")
    assert commands["resume"].endswith("--ckpt_path last")
    assert f"--timeout {int(parts[-1][1]) - 10} " in commands["bench"]
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".json") == sorted(f"{s}.json" for s in STAGES)
    assert [json.loads((out / f"{s}.json").read_text())["ok"] for s in STAGES] == [True] * 5
    table = lines[6:]
    assert table[0].startswith("| stage | result | s | tok/s | MFU | peak mem GiB | compile s |")
    assert [row.split(" | ")[0].lstrip("| ") for row in table[2:]] == STAGES
    assert (out / "summary.md").read_text().splitlines() == table
    fit = yaml.safe_load((out / "fit.yaml").read_text())
    assert fit["trainer"]["devices"] == tp and fit["trainer"]["callbacks"][-1]["class_path"] == "tests.workers.stop_at.StopAt"
    assert fit["data"]["data_dir"] == "data/sample" and fit["model"]["total_batch_size"] == 8 * 1024


def test_a_failed_stage_fails_the_check_and_the_rest_still_run(tmp_path):
    proc = dry_run(tmp_path / "out", 1, FAIL_STAGE="validate")
    assert proc.returncode == 1
    rows = {row.split(" | ")[0].lstrip("| "): row for row in proc.stdout.splitlines() if row.startswith("| ")}
    assert "| FAIL (1) |" in rows["validate"] and "| pass |" in rows["bench"]


def test_refuses_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    proc = dry_run(tmp_path, 1)
    assert proc.returncode == 2
    assert proc.stderr == f"error: gpu_check: {tmp_path} exists and is not a gpu_check folder; set OUT to another folder\n"
    assert (tmp_path / "mine.txt").read_text() == "keep"


@pytest.mark.slow
def test_stage_configs_are_what_cli_reads(tmp_path):
    """cli.py composes configs/tp2.yaml with each stage's file as the check runs it (--print_config: no GPU needed)."""
    out = tmp_path / "out"
    assert dry_run(out, 2).returncode == 0
    for stage, sub in (("fit", "fit"), ("resume", "fit"), ("validate", "validate")):
        proc = subprocess.run([sys.executable, "cli.py", sub, "--config", "configs/tp2.yaml",
                               "--config", str(out / f"{stage}.yaml"), "--print_config"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        printed = yaml.safe_load(proc.stdout)
        assert printed["trainer"]["max_steps"] == 20 and printed["trainer"]["accumulate_grad_batches"] == 1
        assert printed["data"]["batch_size"] * printed["data"]["seq_len"] == printed["model"]["total_batch_size"]
        assert printed["trainer"]["logger"][0]["init_args"]["name"] == stage
