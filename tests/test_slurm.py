"""Slurm: the sbatch scripts under a real single-node Slurm (slurmctld + slurmd + munged started here), preemption by
SIGUSR1 -> checkpoint -> requeue -> resume and by SIGTERM (scancel) -> checkpoint -> exit, and fail-fast behaviour of
real ranks when a peer dies or hangs.

The real-Slurm tests need Debian's slurmctld, slurmd, slurm-client and munge (.ci/run installs them) and root; without
them they are skipped with the reason. The fail-fast and preemption mechanics are also tested without Slurm, on real
processes that get Slurm's environment variables (what srun would set).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT

from gpt_tp.train.slurm import SLURM_ENV_FLAGS, Preemption, PreemptionError, latest_checkpoint

APT = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(pred, timeout: float, what: str, interval: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = pred()
        if out:
            return out
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


# ---------------------------------------------------------------------------------------------------------------
# a single-node Slurm on this machine


class LocalSlurm:
    """munged + slurmctld + one slurmd per node, all state under `root`; stopped by PID. One node is `localhost`;
    two are `n1` and `n2`, both on this host (Debian's Slurm is built with multiple-slurmd support: a slurmd per
    node name, each with its own port and %n in its spool, pid and log paths). Each node has `cpus` CPUs."""

    def __init__(self, root: Path, cpus: int = 2, nodes: int = 1):
        self.root, self.cpus = root, cpus
        self.names = ["localhost"] if nodes == 1 else [f"n{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> "LocalSlurm":
        r = self.root
        for d in ("state", "spool", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        shutil.chown(r / "munge", "munge", "munge")
        os.chmod(r, 0o755)
        key = r / "munge" / "munge.key"
        subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        sock = r / "munge" / "munge.socket"
        self._spawn(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--foreground", f"--socket={sock}",
                     f"--key-file={key}", f"--pid-file={r / 'munge' / 'munged.pid'}", f"--seed-file={r / 'munge' / 'seed'}",
                     f"--log-file={r / 'munge' / 'munged.log'}"], "munged")
        _wait_for(sock.exists, 10, "munged's socket")
        ctld, sd = _free_port(), _free_port()
        if self.names == ["localhost"]:
            node_lines = f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN"
        else:
            node_lines = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} "
                                   f"CPUs={self.cpus} State=UNKNOWN" for n in self.names)
        self.conf.write_text(f"""\
ClusterName=gpttp
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={sd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MailProg=/bin/true
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool' / '%n'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd-%n.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd-%n.log'}
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=15
MinJobAge=600
{node_lines}
PartitionName=debug Nodes={",".join(self.names)} Default=YES MaxTime=INFINITE State=UP
""")
        self._spawn(["setsid", "/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for n in self.names:
            (r / "spool" / n).mkdir(exist_ok=True)
            self._spawn(["setsid", "/usr/sbin/slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}")
        _wait_for(lambda: self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split().count("idle") == len(self.names),
                  30, "every node to be idle")
        return self

    def _spawn(self, cmd, name):
        log = open(self.root / f"{name}.stdout", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def run(self, *cmd, check=True, **kw) -> subprocess.CompletedProcess:
        p = subprocess.run(cmd, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True, timeout=60, **kw)
        if check and p.returncode:
            raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stdout}{p.stderr}")
        return p

    def job(self, job_id: str) -> dict:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def stop(self) -> None:
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged (via runuser: signal the whole session)
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        pid = self.root / "munge" / "munged.pid"
        if pid.exists():  # runuser forwards SIGTERM to munged; make sure it is gone
            try:
                os.kill(int(pid.read_text().strip()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


def _skip_reason() -> str | None:
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey") if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): {APT}"
    if os.geteuid() != 0:
        return "the local Slurm runs its daemons as root (SlurmUser=root) and munged as the munge user: run as root"
    return None


def _cluster(nodes: int):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # not under pytest's tmp root: that is private to root (0700) and munged runs as the munge user
    root = Path(tempfile.mkdtemp(prefix="gpt_tp_slurm_"))
    if subprocess.run(["runuser", "-u", "munge", "--", "test", "-x", str(root.parent)], capture_output=True).returncode:
        shutil.rmtree(root, ignore_errors=True)  # a private TMPDIR (e.g. mode 0700): munged could not reach its key
        pytest.skip(f"the munge user cannot reach the temp folder {root.parent}: set TMPDIR to a folder others can enter")
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


def _wait_state(slurm, job_id, states, timeout):
    return _wait_for(lambda: (j := slurm.job(job_id))["JobState"] in states and j, timeout, f"job {job_id} in {states}", 1)


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


def test_sbatch_trains_with_slurm_ranks(slurm, tmp_path):
    """The CPU sbatch (2 tasks, TP=2 over gloo) runs to max_steps; each Lightning rank is Slurm's SLURM_PROCID.
    The rendezvous port is launch.sh's, from the job id, not the MASTER_PORT exported from the submitting shell."""
    job = _submit(slurm, tmp_path, env={"MAX_STEPS": "8", "MASTER_PORT": "29500"})
    info = _wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}, 300)
    log = (tmp_path / f"slurm-gpt_tp_cpu-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-6000:]
    ranks = _rank_lines(log)
    assert sorted((r[0], r[3]) for r in ranks) == [("0", "0"), ("1", "1")], log[-4000:]  # global rank == SLURM_PROCID
    assert all(r[1] == "2" and r[2] == job for r in ranks)
    assert {(r[6], r[7]) for r in ranks} == {("localhost", str(15000 + int(job) % 16000))}, ranks
    steps = [int(r["step"]) for r in _metrics(tmp_path) if r.get("train/loss")]
    assert sorted(steps) == list(range(8)), steps  # logged at steps 0..7: 8 optimizer steps


def test_preemption_requeues_and_resumes(slurm, tmp_path):
    """scancel --signal=USR1 mid-run (what --signal=USR1@90 sends near the time limit): every rank saves at the
    same step, rank 0 requeues the job, the requeued job resumes from that checkpoint and finishes."""
    job = _submit(slurm, tmp_path, env={"MAX_STEPS": "16"})
    log_path = tmp_path / f"slurm-gpt_tp_cpu-{job}.out"
    _wait_for(lambda: log_path.exists() and "[gpt_tp] rank 0: step 3" in log_path.read_text(), 300, "step 3 of the job")
    slurm.run("scancel", "--signal=USR1", job)
    info = _wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 420)
    log = log_path.read_text()
    assert info["JobState"] == "COMPLETED", log[-6000:]
    assert int(info.get("Restarts", "0")) == 1, info
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
    assert latest_checkpoint(str(tmp_path / "ckpt")) == path


@pytest.mark.parametrize("how", ["scancel", "time limit"])
def test_sigterm_saves_at_a_step_and_ends(slurm, tmp_path, how):
    """scancel without --signal, and the time limit, send SIGTERM, then SIGKILL KillWait (15 s here) later. Every
    rank saves at the same step boundary and exits 143 before the kill: the checkpoint is complete and holds the
    step's weights, nothing is requeued, no task is killed. The time-limit job is trained a while, then its limit
    cut to 1 minute; its early warning signal is SIGURG (ignored), so only the limit's SIGTERM acts."""
    from gpt_tp.train.checkpoint import load_consolidated

    job = _submit(slurm, tmp_path, env={"MAX_STEPS": "400"}, sbatch=("--signal=URG@1",) if how == "time limit" else ())
    log_path = tmp_path / f"slurm-gpt_tp_cpu-{job}.out"
    _wait_for(lambda: log_path.exists() and "[gpt_tp] rank 0: step 3" in log_path.read_text(), 300, "step 3 of the job")
    if how == "scancel":
        slurm.run("scancel", job)
    else:
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=1")
    _wait_for(lambda: slurm.job(job)["JobState"] not in ("RUNNING", "COMPLETING"), 120, f"job {job} to end")
    _wait_for(lambda: slurm.run("squeue", "-h", "-t", "CG", "-j", job, check=False).stdout.strip() == "", 60, "the tasks to end")
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


# ---------------------------------------------------------------------------------------------------------------
# without Slurm: real ranks with the environment srun gives them


def _launch_ranks(tmp_path: Path, *args: str, port: int | None = None) -> list[tuple[subprocess.Popen, Path]]:
    port = port or _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "gpt_tp",
               "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}
        log = tmp_path / f"rank{rank}.log"
        cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(ROOT / "configs" / "cpu.yaml"),
               "--trainer.max_steps", "400", "--trainer.enable_progress_bar", "false",
               "--trainer.callbacks+=gpt_tp.train.slurm.Preemption", f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
               "--trainer.callbacks.requeue=false", "--trainer.callbacks+=gpt_tp.train.slurm.FailFast", *SLURM_ENV_FLAGS.split(), *args]
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT), log))
    return procs


def _wait_training(procs, steps_logged_by: Path | None = None):
    _wait_for(lambda: all("fail-fast watchdog on" in log.read_text() for _, log in procs), 180, "both ranks to train")
    time.sleep(3)  # a few optimizer steps


def _cleanup(procs):
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_peer_failure_ends_the_other_rank(tmp_path, how):
    """kill: SIGKILL rank 1; rank 0's next collective fails (gloo: connection closed) and FailFast exits at once.
    hang: SIGSTOP rank 1 (a hung peer keeps its sockets open, like a stuck GPU under NCCL); the FailFast watchdog
    (stall_timeout_s=8) ends rank 0. Either way: a non-zero exit within the bound and one clear line."""
    procs = _launch_ranks(tmp_path, "--trainer.callbacks.stall_timeout_s=8")
    try:
        _wait_training(procs)
        (p0, log0), (p1, _) = procs
        assert p0.poll() is None and p1.poll() is None
        os.kill(p1.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        rc = p0.wait(timeout=60)
        elapsed = time.monotonic() - t0
        text = log0.read_text()
        assert rc == 75, text[-3000:]
        if how == "kill":
            assert elapsed < 10, elapsed
            assert re.search(r"rank 0: a collective failed at step \d+: another rank died or hung", text), text[-3000:]
        else:
            assert elapsed < 20, elapsed  # the watchdog counts from the last finished step, just before the stop
            m = re.search(r"rank 0: no training progress for (\d+) s \(limit 8 s", text)
            assert m and int(m[1]) >= 8, text[-3000:]
    finally:
        _cleanup(procs)


def test_process_group_timeout_ends_a_rank_waiting_on_a_hung_peer(tmp_path):
    """Without the watchdog, ModelParallelStrategy(timeout=...) bounds the wait: gloo raises after it, FailFast
    reports it as a collective failure."""
    procs = _launch_ranks(tmp_path, "--trainer.callbacks.stall_timeout_s=null", "--trainer.strategy.init_args.timeout=0:00:10")
    try:
        _wait_training(procs)
        (p0, log0), (p1, _) = procs
        os.kill(p1.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        rc = p0.wait(timeout=60)
        elapsed = time.monotonic() - t0
        text = log0.read_text()
        assert rc == 75 and 9 <= elapsed < 25, (rc, elapsed, text[-3000:])
        assert "Timed out waiting 10000ms" in text and "another rank died or hung" in text
    finally:
        _cleanup(procs)


@pytest.mark.skipif(_skip_reason() is None, reason="a real Slurm is installed: test_preemption_requeues_and_resumes and test_scancel_sigterm_saves_at_a_step_and_ends cover this")
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_signal_saves_once_at_the_same_step_and_resumes(tmp_path, sig):
    """Without Slurm: the signal to the ranks at different moments: they agree on one step, save one checkpoint and
    leave (SIGUSR1 without a job to requeue: a clean stop, exit 0; SIGTERM: exit 143); a restart with --ckpt_path
    continues from that step."""
    procs = _launch_ranks(tmp_path)
    try:
        _wait_training(procs)
        os.kill(procs[0][0].pid, signal.Signals[sig])
        time.sleep(0.5)
        os.kill(procs[1][0].pid, signal.Signals[sig])
        rcs = [p.wait(timeout=120) for p, _ in procs]
    finally:
        _cleanup(procs)
    text = procs[0][1].read_text()
    assert rcs == ([0, 0] if sig == "SIGUSR1" else [143, 143]), (rcs, text[-3000:])
    saved = re.findall(rf"preemption signal \({sig}\): saving (\S+) at step (\d+)", text)
    assert len(saved) == 1 and latest_checkpoint(str(tmp_path / "ckpt")) == saved[0][0]
    step = int(saved[0][1])
    procs = _launch_ranks(tmp_path, "--ckpt_path", saved[0][0], "--trainer.max_steps", str(step + 2))
    try:
        rcs = [p.wait(timeout=180) for p, _ in procs]
    finally:
        _cleanup(procs)
    text = procs[0][1].read_text()
    assert rcs == [0, 0], text[-3000:]
    assert f"Restored all states from the checkpoint at {saved[0][0]}" in text


def test_latest_checkpoint_skips_incomplete(tmp_path):
    a, b, c = tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "c.ckpt"
    a.mkdir(), b.mkdir(), c.mkdir()
    (a / "meta.pt").write_bytes(b"x")
    time.sleep(0.01)
    (b / "meta.pt").write_bytes(b"x")
    (c / "__0_0.distcp").write_bytes(b"x")  # cut off before rank 0 wrote meta.pt
    (tmp_path / "d.ckpt.partial").mkdir()
    assert latest_checkpoint(str(tmp_path), str(tmp_path / "missing")) == str(b)
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    out = subprocess.run([sys.executable, "-m", "gpt_tp.train.slurm", "latest", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == str(b)


def test_preemption_refuses_lightnings_auto_requeue(monkeypatch):
    """Inside a Slurm job Lightning picks SLURMEnvironment(auto_requeue=True) by itself, whose SIGUSR1 handler would
    save inside the signal handler: Preemption refuses it with the flags that turn it off (launch.sh passes them).
    With SLURMEnvironment(auto_requeue=False) given explicitly, Preemption's handler is installed and restored."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    for k, v in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "gpt_tp",
                 "SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(k, v)
    kw = dict(accelerator="cpu", devices=1, strategy="ddp", logger=False, enable_progress_bar=False)
    detected = Trainer(**kw).strategy.cluster_environment
    assert isinstance(detected, SLURMEnvironment) and detected.auto_requeue
    with pytest.raises(PreemptionError, match=re.escape(SLURM_ENV_FLAGS)):
        Preemption().setup(Trainer(**kw), None, "fit")
    trainer = Trainer(**kw, plugins=[SLURMEnvironment(auto_requeue=False)])
    before = signal.getsignal(signal.SIGUSR1)
    cb = Preemption()
    cb.setup(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) == cb._on_signal
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) == before


def test_two_nodes_under_sbatch(slurm_two_nodes, tmp_path):
    """`sbatch --nodes=2 --ntasks-per-node=2` on two slurmd of this host (nodes n1, n2): srun starts
    tests/workers/multinode_fit.py 4 times and Lightning's SLURMEnvironment takes the ranks and nodes from srun. Ranks
    0-1 run on n1 and 2-3 on n2, each TP group stays inside a node, each DP group spans both, and the losses equal the
    same run as one node of 4 processes (tests/test_multinode.py), bit for bit."""
    from test_multinode import launch_nodes

    from conftest import WORKERS, read_json

    slurm = slurm_two_nodes
    exports = f"ALL,OMP_NUM_THREADS=1,PYTHONPATH={ROOT},MASTER_ADDR=127.0.0.1,MASTER_PORT={_free_port()}"  # n1, n2 do not resolve
    worker = f"{sys.executable} {WORKERS / 'multinode_fit.py'} --nodes 2 --devices 2 --tp 2 --out {tmp_path / 'two'}"
    job = slurm.run("sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", f"--chdir={tmp_path}",
                    f"--export={exports}", "--output=slurm-%j.out", "--wrap",
                    f"srun --kill-on-bad-exit=1 --cpus-per-task=1 {worker}").stdout.strip().split(";")[0]
    info = _wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}, 300)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-2]", (info, log[-6000:])
    two = read_json(tmp_path / "two.json")
    one = launch_nodes(1, 4, 2, tmp_path / "one")
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
