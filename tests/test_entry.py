"""gpt_tp.entry.run: how every command ends. A user's mistake is one line and exit code 2, once per run; a
distributed process leaves with os._exit after ending its process group, never through the interpreter's shutdown
(where gloo threads kept alive by DTensor's caches abort the process: see gpt_tp/entry.py)."""

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, WORKERS
from gpt_tp.entry import ArgumentParser, pick_device, report, run, torchrun_mesh
from gpt_tp.errors import UserError


def exit_code(main, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        run(main)
    return e.value.code, capsys.readouterr().err


def test_run_exit_codes_and_one_line(capsys):
    def bad():
        raise UserError("model.n_head=5 does not divide\n model.n_embd=64: choose 4 or 8")

    assert exit_code(lambda: None, capsys) == (0, "")
    assert exit_code(lambda: 3, capsys)[0] == 3
    code, err = exit_code(bad, capsys)
    assert code == 2 and err == "error: model.n_head=5 does not divide model.n_embd=64: choose 4 or 8\n"
    code, err = exit_code(lambda: open("no/such/file"), capsys)
    assert code == 2 and err.count("\n") == 1 and "No such file or directory: 'no/such/file'" in err
    code, err = exit_code(lambda: sys.exit("error: --foo must be positive"), capsys)
    assert code == 2 and err == "error: --foo must be positive\n"


def test_bad_flag_and_launch_outside_torchrun_are_one_line(capsys, monkeypatch):
    ap = ArgumentParser("python -m gpt_tp.x", "A command.")
    ap.add_argument("--steps", type=int, default=1)
    code, err = exit_code(lambda: ap.parse_args(["--steps", "two"]), capsys)
    assert (code, err) == (2, "error: argument --steps: invalid int value: 'two' (see python -m gpt_tp.x --help)\n")
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    code, err = exit_code(lambda: torchrun_mesh(1, 2), capsys)
    assert code == 2 and err.startswith("error: run this command under torchrun, e.g. python -m torch.distributed.run")
    monkeypatch.setenv("RANK", "0")  # under torchrun run() leaves with os._exit: call the bootstrap directly
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UserError, match=r"^data-parallel 1 x tensor-parallel 2 = 2 processes, but torchrun started 4: "
                                        r"pass --nproc_per_node=2 or change the layout$"):
        torchrun_mesh(1, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the mistake is --device cuda without CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys):
    code, err = exit_code(lambda: pick_device("cuda"), capsys)
    assert (code, err) == (2, "error: --device cuda: torch finds no CUDA device on this machine; use --device cpu, or "
                              "auto (CUDA when present)\n")


def test_an_error_is_claimed_once_in_the_runs_store_and_leaves_no_file(tmp_path, monkeypatch, capsys):
    """Ranks of one run print an error once: the first to add its key in the run's store (TCPStore, as torchrun's
    agent or rank 0 serves it) prints; nothing is written to disk. With no store answering, only rank 0 prints."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2", "RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for message in ("data.seq_len=9 is wrong", "data.seq_len=9 is wrong", "another"):
        report(message)
    assert capsys.readouterr().err == "error: data.seq_len=9 is wrong\nerror: another\n"
    assert list(tmp_path.iterdir()) == []
    port = store.port
    del store  # the run's store is gone (rank 0 has left): rank 1 says nothing, rank 0 prints
    monkeypatch.setenv("MASTER_PORT", str(port))
    report("after the store")
    monkeypatch.setenv("RANK", "0")
    report("after the store")
    assert capsys.readouterr().err == "error: after the store\n"


def test_a_warning_is_one_line_without_its_source():
    code = "import warnings\nfrom gpt_tp.entry import run\nrun(lambda: warnings.warn('data.seq_len=9 is odd'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "UserWarning: data.seq_len=9 is odd\n")


def test_a_bug_keeps_its_traceback():
    proc = subprocess.run([sys.executable, "-c", "from gpt_tp.entry import run\ndef f(): raise KeyError('x')\nrun(f)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "KeyError: 'x'" in proc.stderr


def torchrun(mode: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKERS / "exit_paths.py"), "--mode", mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def torchruns() -> dict[str, subprocess.CompletedProcess]:
    """exit_paths.py under torchrun in each --mode, the three runs side by side (each its own rendezvous; they share
    nothing): process start-up leaves cores idle that the others use."""
    modes = ("ok", "user-error", "one-rank")
    with ThreadPoolExecutor(len(modes)) as pool:
        return dict(zip(modes, pool.map(torchrun, modes)))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
@pytest.mark.slow
def test_distributed_exit_skips_the_interpreter_shutdown(torchruns):
    proc = torchruns["ok"]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for rank in (0, 1):
        # the cause: after destroy_process_group the mesh's gloo threads still run (DTensor's plan cache holds the mesh)
        m = re.search(rf"rank {rank}: sum 28; gloo threads after destroy_process_group: (\[[^\]]*\])", proc.stdout)
        assert m is not None, out[-3000:]
        assert "pt_gloo_runloop" in m.group(1), m.group(0)
    assert "interpreter shutdown" not in out  # left with os._exit: no finalization for those threads to abort in
    assert "terminate called" not in out


def no_traceback_of_ours(out: str) -> None:
    """torchrun's agent prints its own ChildFailedError traceback; no process of ours prints one."""
    for d in ("gpt_tp", "tests"):
        assert f'File "{ROOT / d}' not in out, out[-3000:]
    assert out.count("Traceback") == out.count("ChildFailedError:"), out[-3000:]


@pytest.mark.slow
def test_same_error_on_every_rank_prints_once(torchruns):
    proc = torchruns["user-error"]
    out = proc.stdout + proc.stderr
    assert [l for l in out.splitlines() if l.startswith("error:")] == ["error: data.seq_len=9 is wrong: set it to 8"]
    no_traceback_of_ours(out)
    assert proc.stderr.count("exitcode  : 2 ") == 2  # both ranks left with the user-error code
    # torchrun's agent then reports the failure itself: its ChildFailedError traceback, and exit code 1 (docs/scale.md)
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr
    assert "interpreter shutdown" not in out


@pytest.mark.slow
def test_an_error_on_one_rank_ends_the_run(torchruns):
    proc = torchruns["one-rank"]
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert [l for l in out.splitlines() if l.startswith("error:")] == ["error: data.seq_len=9 is wrong: set it to 8"]
    no_traceback_of_ours(out)
