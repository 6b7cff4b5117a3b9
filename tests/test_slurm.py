"""Slurm: the sbatch scripts under a real Slurm on this machine (slurmctld + slurmd + munged started here,
tests/workers/local_slurm.py): training with Slurm's ranks, preemption by SIGUSR1 -> checkpoint -> requeue -> resume
and by SIGTERM (scancel, the time limit) -> checkpoint -> exit, and two nodes under sbatch.

They need Debian's slurmctld, slurmd, slurm-client and munge (.ci/run installs them) and root; without them they are
skipped with the reason. tests/test_slurm_ranks.py tests the same mechanics without Slurm.
"""

import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT
from local_slurm import LocalSlurm, free_port, skip_reason, wait_for

from gpt_tp.cluster.slurm import latest_checkpoint

pytestmark = pytest.mark.slow  # a real Slurm: minutes


def _cluster(nodes: int):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="gpt_tp_slurm_"))  # not under pytest's tmp root (local_slurm.skip_reason)
    cluster = LocalSlurm(root, nodes=nodes)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm():
    yield from _cluster(1)


@pytest.fixture
def slurm_two_nodes():
    yield from _cluster(2)


def _submit(slurm: LocalSlurm, work: Path, *args: str, env: dict | None = None, sbatch: tuple[str, ...] = ()) -> str:
    env = {"GPT_TP_REPO": str(ROOT), "GPT_TP_PYTHON": sys.executable, "GPT_TP_CKPT_DIR": str(work / "ckpt"), **(env or {})}
    exports = "ALL," + ",".join(f"{k}={v}" for k, v in env.items())
    out = slurm.run("sbatch", "--parsable", f"--chdir={work}", f"--export={exports}", *sbatch,
                    str(ROOT / "scripts" / "slurm" / "cpu.sbatch"), *args)
    return out.stdout.strip().split(";")[0]


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def _wait_state(slurm, job_id, states, timeout):
    return wait_for(lambda: (j := slurm.job(job_id))["JobState"] in states and j, timeout, f"job {job_id} in {states}", 1)


def _metrics(work: Path) -> list[dict]:
    import csv

    rows = []
    for f in sorted((work / "logs" / "gpt_tp").glob("version_*/metrics.csv")):
        with open(f) as fh:
            rows += [dict(r, _file=str(f)) for r in csv.DictReader(fh)]
    return rows


def _rank_lines(log: str) -> list[tuple[str, ...]]:
    return re.findall(r"\[gpt_tp\] rank (\d+) of (\d+): SLURM_JOB_ID=(\d+) SLURM_PROCID=(\d+) SLURM_LOCALID=(\d+) "
                      r"SLURM_NODEID=(\d+) MASTER_ADDR=(\S+) MASTER_PORT=(\d+)", log)


def test_sbatch_trains_with_slurm_ranks_and_preemption_requeues_and_resumes(slurm, tmp_path):
    """The CPU sbatch (2 tasks, TP=2 over gloo), each Lightning rank Slurm's SLURM_PROCID, its rendezvous port
    launch.sh's, from the job id, not the MASTER_PORT exported from the submitting shell. scancel --signal=USR1
    mid-run (what --signal=USR1@90 sends near the time limit): every rank saves at the same step, rank 0 requeues the
    job, the requeued job resumes from that checkpoint and runs to max_steps, every step logged once."""
    job = _submit(slurm, tmp_path, env={"MAX_STEPS": "16", "MASTER_PORT": "29500"})
    log_path = tmp_path / f"slurm-gpt_tp_cpu-{job}.out"
    wait_for(lambda: log_path.exists() and "[gpt_tp] rank 0: step 3" in log_path.read_text(), 300, "step 3 of the job")
    slurm.run("scancel", "--signal=USR1", job)
    info = _wait_state(slurm, job, ENDED, 420)
    log = log_path.read_text()
    assert info["JobState"] == "COMPLETED", log[-6000:]
    assert int(info.get("Restarts", "0")) == 1, info
    ranks = _rank_lines(log)  # each start of the job: its two ranks
    assert sorted((r[0], r[3]) for r in ranks) == [("0", "0"), ("0", "0"), ("1", "1"), ("1", "1")], log[-4000:]
    assert all(r[1] == "2" and r[2] == job for r in ranks)
    assert {(r[6], r[7]) for r in ranks} == {("localhost", str(15000 + int(job) % 16000))}, ranks
    saved = re.findall(r"preemption signal \(SIGUSR1\): saving (\S+) at step (\d+)", log)
    assert len(saved) == 1, log[-6000:]
    path, step = saved[0][0], int(saved[0][1])
    assert 0 < step < 16 and Path(path, "meta.pt").is_file()
    assert f"resume {path}" in log and f"Restored all states from the checkpoint at {path}" in log, log[-6000:]
    assert re.search(r"scontrol requeue \d+ -> ok", log)
    assert "SLURM auto-requeueing enabled" not in log and "hpc_ckpt" not in log  # Lightning's own requeue stays off
    assert log.count("checkpoint saved, job requeued: exiting") == 2 and "Killed" not in log, log[-6000:]
    rows = [r for r in _metrics(tmp_path) if r.get("train/loss")]
    files = sorted({r["_file"] for r in rows})
    assert len(files) == 2, files  # one CSV per run: before and after the requeue
    after = [int(r["step"]) for r in rows if r["_file"] == files[1]]
    assert min(after) == step and max(after) == 15, after  # continues at the saved step, ends at max_steps
    before = [int(r["step"]) for r in rows if r["_file"] == files[0]]
    assert max(before) == step - 1, before  # nothing lost: the first run logged every step up to the checkpoint
    assert sorted(before + after) == list(range(16)), (before, after)  # 16 optimizer steps, each logged once
    assert latest_checkpoint(str(tmp_path / "ckpt")) == path


@pytest.mark.parametrize("how", ["scancel", "time limit"])
def test_sigterm_saves_at_a_step_and_ends(slurm, tmp_path, how):
    """scancel without --signal, and the time limit, send SIGTERM, then SIGKILL KillWait (15 s here) later. Every
    rank saves at the same step boundary and exits 143 before the kill: the checkpoint is complete and holds the
    step's weights, nothing is requeued, no task is killed. The time-limit job is trained a while, then its limit
    cut to 1 minute; its early warning signal is SIGURG (ignored), so only the limit's SIGTERM acts."""
    from gpt_tp.checkpoint import load_consolidated

    job = _submit(slurm, tmp_path, env={"MAX_STEPS": "400"}, sbatch=("--signal=URG@1",) if how == "time limit" else ())
    log_path = tmp_path / f"slurm-gpt_tp_cpu-{job}.out"
    wait_for(lambda: log_path.exists() and "[gpt_tp] rank 0: step 3" in log_path.read_text(), 300, "step 3 of the job")
    if how == "scancel":
        slurm.run("scancel", job)
    else:
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=1")
    # an end state, not merely "not RUNNING": the --signal=URG@1 warning shows the job as SIGNALING while it runs on
    _wait_state(slurm, job, ENDED, 180)
    wait_for(lambda: slurm.run("squeue", "-h", "-t", "CG", "-j", job, check=False).stdout.strip() == "", 60, "the tasks to end")
    log = log_path.read_text()
    info = slurm.job(job)
    assert info["JobState"] == ("CANCELLED" if how == "scancel" else "TIMEOUT"), (info, log[-4000:])
    assert int(info.get("Restarts", "0")) == 0, info
    saved = re.findall(r"preemption signal \(SIGTERM\): saving (\S+) at step (\d+)", log)
    assert len(saved) == 1, log[-6000:]
    path, step = saved[0][0], int(saved[0][1])
    assert sorted(re.findall(r"rank (\d): checkpoint saved after SIGTERM: exiting", log)) == ["0", "1"], log[-6000:]
    assert "Killed" not in log and "scontrol requeue" not in log, log[-6000:]
    assert 3 <= step < 400 and latest_checkpoint(str(tmp_path / "ckpt")) == path
    config, sd = load_consolidated(Path(path))  # every rank's shards are there
    assert sd["transformer.wte.weight"].shape == (config.vocab_size, config.n_embd)
    steps = [int(r["step"]) for r in _metrics(tmp_path) if r.get("train/loss")]
    assert max(steps) == step - 1, steps  # every step up to the checkpoint logged


def test_two_nodes_under_sbatch(slurm_two_nodes, tmp_path, one_node_of_4):
    """`sbatch --nodes=2 --ntasks-per-node=2` on two slurmd of this host (nodes n1, n2): srun starts
    tests/workers/multinode_fit.py 4 times and Lightning's SLURMEnvironment takes the ranks and nodes from srun. Ranks
    0-1 run on n1 and 2-3 on n2, each TP group stays inside a node, each DP group spans both, and the losses equal the
    same run as one node of 4 processes (tests/test_multinode.py), bit for bit."""
    from conftest import WORKERS, read_json

    slurm = slurm_two_nodes
    exports = f"ALL,OMP_NUM_THREADS=1,PYTHONPATH={ROOT},MASTER_ADDR=127.0.0.1,MASTER_PORT={free_port()}"  # n1, n2 do not resolve
    worker = f"{sys.executable} {WORKERS / 'multinode_fit.py'} --nodes 2 --devices 2 --tp 2 --out {tmp_path / 'two'}"
    job = slurm.run("sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", f"--chdir={tmp_path}",
                    f"--export={exports}", "--output=slurm-%j.out", "--wrap",
                    f"srun --kill-on-bad-exit=1 --cpus-per-task=1 {worker}").stdout.strip().split(";")[0]
    info = _wait_state(slurm, job, ENDED, 300)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-2]", (info, log[-6000:])
    two = read_json(tmp_path / "two.json")
    one = one_node_of_4
    assert len(two["losses"]) == 4 and two["losses"][-1] < two["losses"][0]
    assert two["losses"] == one["losses"]
    ranks = {r["rank"]: r for r in two["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    for r in ranks.values():
        assert r["node_rank"] == r["env_node_rank"] == r["rank"] // 2 and r["local_rank"] == r["rank"] % 2
        assert r["slurm_node"] == f"n{r['node_rank'] + 1}"
        assert len(r["tp_group"]) == 2 and {ranks[q]["node_rank"] for q in r["tp_group"]} == {r["node_rank"]}
        assert len(r["dp_group"]) == 2 and {ranks[q]["node_rank"] for q in r["dp_group"]} == {0, 1}
    assert {tuple(r["tp_group"]) for r in ranks.values()} == {(0, 1), (2, 3)}
