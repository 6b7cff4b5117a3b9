"""tests/tools/zygote.py: a process started through the preloaded server behaves as one of the real interpreter: the
same state at start (argv, sys.path, environment, working directory, signal dispositions, standard streams), exit
codes, tracebacks, death by signal, forwarded signals, stops; outside the server's session it leads a session of its
own and signals to the client's process group reach it and the processes it started."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REAL_PYTHON, ROOT, start_zygote, stop_zygote

PROBE = r"""
import json, os, signal, sys, warnings
state = {
    "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__, "file": globals().get("__file__"),
    "spec": repr(globals().get("__spec__")), "env": {k: os.environ.get(k) for k in ("ZY", "PYTHONPATH", "OMP_NUM_THREADS")},
    "signals": {str(s): repr(signal.getsignal(s)) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "umask": os.umask(0o22), "pgid": os.getpgid(0) == os.getpgid(os.getppid()) if "ZY_PG" in os.environ else None,
    "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding, sys.stdout.errors],
    "stderr": [sys.stderr.line_buffering, sys.stderr.write_through, sys.stderr.errors], "stdin": sys.stdin.read(),
    "warnoptions": sys.warnoptions, "bytecode": sys.dont_write_bytecode, "xoptions": sys._xoptions,
    "filters": [[a, getattr(m, "pattern", m), c.__name__, getattr(mod, "pattern", mod), n] for a, m, c, mod, n in warnings.filters],
}
print(json.dumps(state))
print("preloaded" if "torch" in sys.modules else "fresh", file=sys.stderr)
"""


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """OMP_NUM_THREADS=1, as the suite's processes have it and the server runs with; the zygote on."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("GPT_TP_NO_ZYGOTE", raising=False)


@pytest.fixture(scope="module")
def client(zygote, tmp_path_factory):
    """The session's zygote, or one of the test's own under GPT_TP_NO_ZYGOTE=1 (it is what is tested), serving."""
    server = None
    if zygote is None:
        folder = tmp_path_factory.mktemp("zygote_test")
        server, zygote = start_zygote(folder)
    folder = Path(zygote).parent
    assert (folder / "socket").exists(), (folder / "server.log").read_text()  # start_zygote waited for it
    yield zygote
    if server is not None:
        stop_zygote(server, folder)


def run(python, *args, **kw):
    kw.setdefault("cwd", ROOT)
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=120, **kw)


def probe_both(client, tmp_path, *flags, script=True, **kw):
    """The probe's state through the zygote and from the real interpreter, with the same arguments."""
    (tmp_path / "probe.py").write_text(PROBE)
    target = [str(tmp_path / "probe.py")] if script else ["-c", PROBE]
    got = []
    for python in (client, REAL_PYTHON):
        proc = run(python, *flags, *target, "a", "--b", **kw)
        assert proc.returncode == 0, proc.stderr
        got.append((json.loads(proc.stdout), proc.stderr.strip().splitlines()[-1]))
    assert got[0][1] == "preloaded" and got[1][1] == "fresh"
    (zy, _), (real, _) = got
    # the filters a fresh process starts with come last; the preloaded modules' own go before them, as on their import
    assert zy["filters"][len(zy["filters"]) - len(real["filters"]):] == real["filters"]
    zy["filters"] = real["filters"]
    return zy, real


def test_a_served_process_starts_as_a_fresh_one(client, tmp_path):
    env = {**os.environ, "ZY": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}relative", "ZY_PG": "1"}
    zy, real = probe_both(client, tmp_path, input="stdin text", env=env, cwd=tmp_path)
    assert zy == real and zy["stdin"] == "stdin text" and zy["argv"][1:] == ["a", "--b"] and zy["pgid"]
    assert zy["signals"][str(int(signal.SIGINT))] == repr(signal.default_int_handler)
    zy, real = probe_both(client, tmp_path, "-u", "-B", "-W", "error::UserWarning", script=False,
                          env={**env, "PYTHONWARNINGS": "ignore::FutureWarning"})
    assert zy == real and zy["stdout"][1] and zy["bytecode"] and len(zy["warnoptions"]) == 2


def test_ignored_sigint_stays_ignored(client):
    code = "import signal, sys; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, len(sys.modules) > 1000)"
    zy = subprocess.run(["sh", "-c", f"trap '' INT; {client} -c '{code}'"], capture_output=True, text=True)
    assert zy.stdout == "True True\n", zy.stderr


def test_module_and_exit_codes(client):
    assert run(client, "-m", "json.tool", input='{"a": [1]}').stdout == run(REAL_PYTHON, "-m", "json.tool", input='{"a": [1]}').stdout
    # a module the server preloaded (every gpt_tp module) runs as __main__ as in a fresh interpreter: no runpy warning
    zy, real = (run(python, "-m", "gpt_tp.train.plot", "no/such/run") for python in (client, REAL_PYTHON))
    assert (zy.returncode, zy.stdout, zy.stderr) == (real.returncode, real.stdout, real.stderr) == (2, "", zy.stderr)
    assert zy.stderr.startswith("error: ") and len(zy.stderr.splitlines()) == 1, zy.stderr
    assert run(client, "-c", "import sys; sys.exit(3)").returncode == 3
    for code in ("raise SystemExit('bye')", "def f():\n    raise KeyError('x')\nf()", "import nowhere_such_module",
                 "raise KeyboardInterrupt", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"):
        zy, real = run(client, "-c", code), run(REAL_PYTHON, "-c", code)
        assert (zy.returncode, zy.stdout, zy.stderr) == (real.returncode, real.stdout, real.stderr), code
    assert run(client, "-c", "raise KeyboardInterrupt").returncode == -signal.SIGINT
    missing = run(client, "no_such_script.py")
    assert missing.returncode == 2 and "can't open file" in missing.stderr


def test_signals_reach_the_child_and_its_death_is_the_clients(client, tmp_path):
    code = ("import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: (print('usr1', flush=True), sys.exit(7)))\n"
            "print('ready', flush=True)\ntime.sleep(60)")
    for sig, want in ((signal.SIGUSR1, 7), (signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)):
        proc = subprocess.Popen([client, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == want, err
        assert ("usr1" in out) == (sig == signal.SIGUSR1) and ("KeyboardInterrupt" in err) == (sig == signal.SIGINT)


def test_a_killed_or_stopped_client_kills_or_stops_its_child(client, tmp_path):
    code = "import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)"
    proc = subprocess.Popen([client, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert child != proc.pid

    def state():
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return None

    def wait(cond):
        deadline = time.monotonic() + 60
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.05)
        return cond()

    proc.send_signal(signal.SIGSTOP)
    assert wait(lambda: state() == "T")
    proc.send_signal(signal.SIGCONT)
    assert wait(lambda: state() == "S")
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert wait(lambda: state() is None)


SESSION = r"""
import os, signal, subprocess, sys, time
name = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *a: (os.write(1, f"{name} SIGTERM\n".encode()), os._exit(3)))  # one write
print(name, "leads its session" if os.getsid(0) == os.getpid() else "in its parent's session",
      "preloaded" if "torch" in sys.modules else "fresh", flush=True)
if name == "child":
    subprocess.Popen([sys.executable, __file__, "grandchild"])
time.sleep(120)
"""


@pytest.mark.parametrize("interpreter", ["served", "real"])
def test_another_session_gets_a_session_of_its_own_and_its_group_signals(client, tmp_path, interpreter):
    """A client started in a new session (start_new_session, torchrun's workers, Slurm's tasks) is served: its child
    leads a session of its own, as does the child of a process that child starts. SIGTERM to the client's process
    group reaches both, as it does on the real interpreter (GPT_TP_NO_ZYGOTE=1), where the grandchild stays in the
    child's session; the client exits as the child did."""
    script = tmp_path / "session.py"
    script.write_text(SESSION)
    env = {**os.environ, **({"GPT_TP_NO_ZYGOTE": "1"} if interpreter == "real" else {})}
    proc = subprocess.Popen([client, str(script), "child"], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        os.killpg(proc.pid, signal.SIGTERM)
        rest = proc.stdout.read().split("\n")  # until the grandchild, which holds the pipe too, has ended
        assert proc.wait(timeout=60) == 3
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    how = "preloaded" if interpreter == "served" else "fresh"
    assert lines == ["child leads its session " + how,
                     "grandchild " + ("leads its session " if interpreter == "served" else "in its parent's session ") + how]
    assert sorted(filter(None, rest)) == ["child SIGTERM", "grandchild SIGTERM"]


def test_the_switch_runs_the_real_interpreter(client):
    code = "import os, sys; print(os.getpid(), 'torch' in sys.modules)"
    proc = subprocess.Popen([client, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "GPT_TP_NO_ZYGOTE": "1"})
    assert proc.communicate(timeout=120)[0] == f"{proc.pid} False\n"
    served = run(client, "-c", code)
    assert served.stdout.split()[1] == "True"
    for flag in ("-I", "-Xfaulthandler"):  # flags it does not reproduce
        unknown = run(client, flag, "-c", "import sys; print(sys.flags.isolated, sys._xoptions, len(sys.modules) > 1000)")
        assert unknown.stdout == ("1 {} False\n" if flag == "-I" else "0 {'faulthandler': True} False\n")


def test_a_sitecustomize_on_the_path_runs_the_real_interpreter(client, tmp_path):
    """site imports a sitecustomize found on sys.path at start, which the server's child would not: the real one."""
    (tmp_path / "sitecustomize.py").write_text("print('site ran')\n")
    code, env = "import sys; print(len(sys.modules) > 1000)", {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert run(client, "-c", code, env=env).stdout == run(REAL_PYTHON, "-c", code, env=env).stdout == "site ran\nFalse\n"


def test_the_environment_read_on_import(client):
    """A variable a preloaded module read on import, changed: the real interpreter; one it did not read, or read only
    in a scan of the whole environment (fsspec's for FSSPEC_*): served;
    Lightning's rank for rank_zero_only, read from RANK/LOCAL_RANK on import: as a fresh process has it."""
    code = "import sys; print(len(sys.modules) > 1000)"
    assert run(client, "-c", code, env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout == "False\n"
    assert run(client, "-c", code, env={**os.environ, "PL_GLOBAL_SEED": "3"}).stdout == "True\n"
    if "PYTEST_XDIST_WORKER" in os.environ:  # in the server's environment, read on import only by scans of all of it
        assert run(client, "-c", code, env={**os.environ, "PYTEST_XDIST_WORKER": "other"}).stdout == "True\n"
    code = "import lightning.pytorch; from lightning_utilities.core.rank_zero import rank_zero_only; print(rank_zero_only.rank)"
    for env in ({"RANK": "3", "LOCAL_RANK": "1"}, {}):
        env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}, **env}
        assert run(client, "-c", code, env=env).stdout == run(REAL_PYTHON, "-c", code, env=env).stdout, env


def test_the_thread_count_is_that_of_a_fresh_process(client):
    """OMP_NUM_THREADS is read by libgomp and torch at start, not by Python. Unset, the served child runs the intra-op
    thread count a fresh process has (the server runs 1); another count (torch caps it by the cores): the real one."""
    code = "import sys; served = 'torch' in sys.modules; import torch; print(served, torch.get_num_threads())"
    unset = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    zy, real = (run(python, "-c", code, env=unset).stdout.split() for python in (client, REAL_PYTHON))
    assert zy[0] == "True" and real[0] == "False" and zy[1] == real[1], (zy, real)
    assert run(client, "-c", code, env={**unset, "OMP_NUM_THREADS": "3"}).stdout.split()[0] == "False"
