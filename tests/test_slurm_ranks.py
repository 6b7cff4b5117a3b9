"""Slurm's mechanics without Slurm: real ranks of `cli.py fit` given the environment srun sets. Fail-fast when a
peer dies or hangs, the process-group timeout, preemption signals saving one checkpoint at one step, finding the
latest checkpoint, and Preemption refusing Lightning's own auto-requeue."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from local_slurm import free_port, skip_reason, wait_for

from gpt_tp.cluster.slurm import SLURM_ENV_FLAGS, Preemption, PreemptionError, latest_checkpoint


def _launch_ranks(tmp_path: Path, *args: str, port: int | None = None) -> list[tuple[subprocess.Popen, Path]]:
    port = port or free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "gpt_tp",
               "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}
        log = tmp_path / f"rank{rank}.log"
        cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(ROOT / "configs" / "cpu.yaml"),
               "--trainer.max_steps", "400", "--trainer.enable_progress_bar", "false",
               "--trainer.callbacks+=gpt_tp.cluster.slurm.Preemption", f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
               "--trainer.callbacks.requeue=false", "--trainer.callbacks+=gpt_tp.cluster.slurm.FailFast",
               "--trainer.callbacks.report_every_n_steps=1", *SLURM_ENV_FLAGS.split(), *args]
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT), log))
    return procs


def _wait_training(procs):
    # a few optimizer steps (both ranks take each one together): FailFast's heartbeat, every step on rank 0
    wait_for(lambda: "rank 0: step 3\n" in procs[0][1].read_text(), 240, "three optimizer steps", interval=0.2)


def _cleanup(procs):
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.parametrize("how", ["kill", "hang"])
@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.skipif(skip_reason() is None, reason="a real Slurm is installed: test_sbatch_trains_with_slurm_ranks_and_preemption_requeues_and_resumes and test_sigterm_saves_at_a_step_and_ends (tests/test_slurm.py) cover this")
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
@pytest.mark.slow
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


def test_latest_checkpoint_skips_incomplete(tmp_path, command_here):
    """latest_checkpoint, and `python -m gpt_tp.cluster.slurm latest`'s entry (in this process; launch.sh runs that
    process in tests/test_slurm.py's jobs): the newest folder with meta.pt."""
    from gpt_tp.cluster.slurm import main as slurm_main

    a, b, c = tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "c.ckpt"
    a.mkdir(), b.mkdir(), c.mkdir()
    (a / "meta.pt").write_bytes(b"x")
    time.sleep(0.01)
    (b / "meta.pt").write_bytes(b"x")
    (c / "__0_0.distcp").write_bytes(b"x")  # cut off before rank 0 wrote meta.pt
    (tmp_path / "d.ckpt.partial").mkdir()
    assert latest_checkpoint(str(tmp_path), str(tmp_path / "missing")) == str(b)
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    out = command_here(lambda: slurm_main(["latest", str(tmp_path)]))
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
