"""No rank waits on a failed peer: what one rank does for all (a HellaSwag download, samples.txt and its folder)
shares its failure with every rank (gpt_tp.collective.one_does), which all exit with that error.

Each test starts the ranks of a TP=2 job as separate processes (the environment torchrun would give them, without
torchrun, which would end the survivors itself) and injects one failure on rank 0's side. Every process must exit
on its own with code 2 within 30 s of the first, and the error line appears once, with no traceback.
"""

import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import ROOT, WORKERS

from gpt_tp.collective import _portable, one_does

OFFLINE = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path: Path, args: list[str], world: int = 2, env: dict | None = None, timeout: float = 300):
    """Start `python args...` as ranks 0..world-1; return (exit codes, their output, seconds from the first exit to
    the last)."""
    port = _free_port()
    procs = []
    for rank in range(world):
        e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
             "NODE_RANK": "0", **(env or {})}
        e.pop("TORCHELASTIC_RUN_ID", None)
        log = open(tmp_path / f"rank{rank}.log", "w+")
        procs.append((subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=e, stdout=log, stderr=subprocess.STDOUT), log))
    end = time.monotonic() + timeout
    exited: dict[int, float] = {}
    try:
        while len(exited) < world and time.monotonic() < end:
            for i, (p, _) in enumerate(procs):
                if i not in exited and p.poll() is not None:
                    exited[i] = time.monotonic()
            if exited and time.monotonic() - min(exited.values()) > 60:
                break  # a rank left waiting: reported below
            time.sleep(0.2)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    out = []
    for _, log in procs:
        log.seek(0)
        out.append(log.read())
        log.close()
    codes = [p.returncode for p, _ in procs]
    spread = max(exited.values()) - min(exited.values()) if len(exited) == world else float("inf")
    return codes, out, spread


def assert_all_exit_with(codes, out, spread, message: str):
    text = "\n".join(f"--- rank {i} ---\n{o[-3000:]}" for i, o in enumerate(out))
    assert codes == [2] * len(codes), (codes, text)
    assert spread < 30, (spread, text)  # no rank waited for the process group's timeout
    lines = [line for o in out for line in o.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], text  # once per run, on whichever rank claimed it
    assert "Traceback" not in text, text


@pytest.mark.slow
def test_hellaswag_callback_download_failure_ends_every_rank(tmp_path):
    codes, out, spread = run_ranks(tmp_path, [str(WORKERS / "hellaswag_fit.py"), "--out", str(tmp_path / "fit"),
                                              "--hellaswag-cache", str(tmp_path / "cache")], env=OFFLINE)
    assert_all_exit_with(codes, out, spread, "could not download HellaSwag from https://")


@pytest.mark.slow
def test_sample_writing_failure_ends_every_rank(tmp_path):
    """Rank 0 cannot append samples.txt (a folder has its name) at step 2: both ranks exit with its error."""
    codes, out, spread = run_ranks(tmp_path, [str(WORKERS / "hellaswag_fit.py"), "--out", str(tmp_path / "fit"), "--break", "samples.txt"])
    assert_all_exit_with(codes, out, spread, f"IsADirectoryError: [Errno 21] Is a directory: '{tmp_path}/fit_logs/run/version_0/samples.txt'")
    assert "step 2: HellaSwag acc_norm" in out[0]  # it failed where intended: after the step-2 evaluation


class TwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def test_errors_cross_processes_as_they_are():
    """What the all-gather pickles: an exception that round-trips as itself, else a RuntimeError with its text."""
    e = _portable(FileNotFoundError(2, "No such file", "x.jsonl"))
    assert isinstance(e, FileNotFoundError) and str(e) == "[Errno 2] No such file: 'x.jsonl'"
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(TwoArgs(1, 2)))
    e = _portable(TwoArgs(1, 2))
    assert type(e) is RuntimeError and str(e) == "TwoArgs: 1/2"
    assert not dist.is_initialized() and one_does(lambda: 7) == 7  # one process: fn just runs
