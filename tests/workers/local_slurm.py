"""A single-node Slurm on this machine for tests/test_slurm.py (munged + slurmctld + slurmd, started and stopped
here), and the small waits the Slurm tests share."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

APT = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, what: str, interval: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = pred()
        if out:
            return out
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")



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
        wait_for(sock.exists, 10, "munged's socket")
        ctld, sd = free_port(), free_port()
        if self.names == ["localhost"]:
            node_lines = f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN"
        else:
            node_lines = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
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
        wait_for(lambda: self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split().count("idle") == len(self.names),
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


def skip_reason() -> str | None:
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey") if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): {APT}"
    if os.geteuid() != 0:
        return "the local Slurm runs its daemons as root (SlurmUser=root) and munged as the munge user: run as root"
    # the cluster's folder is made in the temp folder (pytest's tmp root is private to root), where munged, running as
    # the munge user, must reach its key: a private TMPDIR (e.g. mode 0700) keeps it out
    tmp = tempfile.gettempdir()
    if subprocess.run(["runuser", "-u", "munge", "--", "test", "-x", tmp], capture_output=True).returncode:
        return f"the munge user cannot reach the temp folder {tmp}: set TMPDIR to a folder others can enter"
    return None
