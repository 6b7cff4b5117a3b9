import ast
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

# One thread per process: two pytest-xdist workers share the 2 cores. The zygote's server runs with this value; a process
# started with it, or without the variable (its child takes torch's default count), is forked from the server; with
# another value it runs the real interpreter, ~10 s more. Set before torch is imported, so the workers' own torch runs
# one thread too. Tests of what users run remove it for their processes (test_cli, test_user_paths, test_io_faults,
# test_bad_inputs).
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

from gpt_tp.data.tokenizer import get_encoding
from gpt_tp.model import GPT, GPTConfig

# test-only helpers shared by tests and their worker scripts (e.g. synthetic_data) live in tests/workers
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"
TOOLS = ROOT / "tests" / "tools"
REAL_PYTHON = sys.executable  # the interpreter pytest runs on; sys.executable becomes the zygote's client
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"  # tiktoken's source of r50k_base


def start_zygote(folder: Path) -> tuple[subprocess.Popen, str]:
    """tests/tools/zygote.py's server on folder/socket (it serves once its imports are done; until then the client runs
    the real interpreter) and its client, an executable standing in for REAL_PYTHON."""
    sock = folder / "socket"
    log = open(folder / "server.log", "w")
    # OMP_NUM_THREADS=1 (as the suite's processes have it): with more, importing torch starts a thread and the server
    # must not fork; a process with another value runs the real interpreter
    server = subprocess.Popen([REAL_PYTHON, str(TOOLS / "zygote.py"), str(sock)], stdin=subprocess.DEVNULL, stdout=log,
                              stderr=subprocess.STDOUT,
                              env={**{k: v for k, v in os.environ.items() if k != "GPT_TP_NO_ZYGOTE"}, "OMP_NUM_THREADS": "1"})
    log.close()
    # it listens within a second, before its imports: with the socket there, the first test's clients wait for the
    # imports instead of starting the real interpreter
    deadline = time.monotonic() + 60
    while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.path.insert(0, str(TOOLS))
    from zygote import write_client

    sys.path.remove(str(TOOLS))
    return server, write_client(str(sock), str(folder / "python"), REAL_PYTHON)


def stop_zygote(server: subprocess.Popen, folder: Path) -> None:
    (folder / "socket").unlink(missing_ok=True)
    server.terminate()
    server.wait(timeout=60)


@pytest.fixture(scope="session", autouse=True)
def zygote(tmp_path_factory):
    """Every `[sys.executable, ...]` a test starts runs through tests/tools/zygote.py: a preloaded interpreter forks
    it in milliseconds, as a fresh one would run it (or execs the real interpreter where it cannot). The client's path,
    or None with GPT_TP_NO_ZYGOTE=1 (every process a real interpreter)."""
    if os.environ.get("GPT_TP_NO_ZYGOTE") == "1":
        yield None
        return
    folder = tmp_path_factory.mktemp("zygote")
    server, client = start_zygote(folder)
    sys.executable = client
    try:
        yield client
    finally:
        sys.executable = REAL_PYTHON
        stop_zygote(server, folder)


@pytest.fixture(autouse=True)
def real_interpreter(request, monkeypatch):
    """A test marked real_interpreter (it shows what a fresh interpreter does: tests/test_fresh.py) starts its processes
    on the real interpreter."""
    if request.node.get_closest_marker("real_interpreter"):
        monkeypatch.setattr(sys, "executable", REAL_PYTHON)


@pytest.fixture(scope="session")
def tiktoken_cache(tmp_path_factory):
    """tiktoken's own r50k_base loader, offline: TIKTOKEN_CACHE_DIR = a folder holding gpt_tp's shipped ranks file
    under tiktoken's cache key (the sha1 of its URL), so tiktoken.get_encoding("r50k_base") is an independent reference."""
    from gpt_tp.data.tokenizer import RANKS

    d = tmp_path_factory.mktemp("tiktoken_cache")
    shutil.copyfile(RANKS, d / hashlib.sha1(R50K_URL.encode()).hexdigest())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(d))
        yield d


def run_torchrun(script: str, nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run tests/workers/<script> on nproc real processes (gloo, CPU, one thread each); fail with its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKERS / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{script} x{nproc} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_python(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(WORKERS / script), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def one_error_line(proc) -> str:
    """A user's mistake: exit code 2, no traceback anywhere in the output, exactly one `error:` line; returns it."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and 'File "' not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def enc():
    """GPT-2's tokenizer (the shipped r50k_base ranks)."""
    return get_encoding()


@pytest.fixture(scope="module")
def tiny():
    """A tiny GPT with fixed random weights, in eval mode."""
    torch.manual_seed(1234)
    return GPT(GPTConfig.from_name("tiny")).eval()


@pytest.fixture
def user_run(monkeypatch, capsys):
    """Run a command's main in this process as its __main__ does (gpt_tp.entry.run), from the repository root;
    return its one error line. For mistakes caught before any process group starts."""
    from gpt_tp.entry import run

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    for k in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT", "MASTER_ADDR", "RANK"):
        monkeypatch.delenv(k, raising=False)

    def go(main) -> str:
        threads = torch.get_num_threads()  # cli.py sets it for its processes
        with pytest.raises(SystemExit) as e:
            run(main)
        torch.set_num_threads(threads)
        out = capsys.readouterr()
        return one_error_line(SimpleNamespace(returncode=e.value.code, stdout=out.out, stderr=out.err))

    return go


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def pytest_configure(config):
    """SIGINT's default disposition in the test process, so every child it starts sees Ctrl-C as a terminal's would.
    A shell starts a background job (`cmd &` without job control) with SIGINT ignored (POSIX), an exec keeps an
    ignored signal ignored, and a test that sends SIGINT would then test nothing."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "real_interpreter: its processes start on the real interpreter, not the zygote")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker collects the same list: the order WorkUnits hands it out
        seconds, total = read_json(DURATIONS), {}
        for item in items:
            total[unit_of(item.nodeid)] = total.get(unit_of(item.nodeid), 0.0) + seconds.get(item.nodeid, 1.0)
        items.sort(key=lambda item: (-total[unit_of(item.nodeid)], unit_of(item.nodeid)))  # stable: a unit keeps its order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- the suite on two cores (README: `-n 2`, pytest-xdist) -------------------------------------------------------
# A worker takes whole work units: a test file (its module fixtures are made once), or the files that take one of
# SHARED_RUNS (a session fixture's launch, made once by the one worker that runs them all). Units go out longest first
# by tests/durations.json (each test's seconds, setup and teardown included), so the two workers end together.
SHARED_RUNS = ("lightning_runs", "parity_runs", "one_node_of_4")
DURATIONS = ROOT / "tests" / "durations.json"


def unit_of(nodeid: str) -> str:
    return work_units()[nodeid.split("::")[0]]


@functools.cache
def work_units() -> dict[str, str]:
    """Each test file's work unit: the file, or one shared by all files whose functions take one of SHARED_RUNS
    (linked through the runs they take)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    files = {f"tests/{path.name}": ast.parse(path.read_text()) for path in sorted((ROOT / "tests").glob("test_*.py"))}
    for file, tree in files.items():
        taken = {a.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for a in node.args.args}
        for run in taken.intersection(SHARED_RUNS):
            parent[root(file)] = root(run)
    return {file: root(file) for file in files}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduler, its scope a work unit (unit_of), the units in collection order (pyproject's
    addopts: --dist loadscope --no-loadscope-reorder)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return WorkUnits(config, log)


def pytest_runtest_logreport(report):
    """GPT_TP_DURATIONS=1: add each test's seconds (its setup, call and teardown) to tests/durations.json at the end."""
    if os.environ.get("GPT_TP_DURATIONS") == "1" and not os.environ.get("PYTEST_XDIST_WORKER"):
        MEASURED[report.nodeid] = MEASURED.get(report.nodeid, 0.0) + report.duration


MEASURED: dict[str, float] = {}


def pytest_sessionfinish(session):
    if MEASURED:
        old = read_json(DURATIONS)
        DURATIONS.write_text(json.dumps({**old, **{k: round(v, 1) for k, v in MEASURED.items()}}, indent=0, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A 1-step checkpoint of configs/cpu.yaml's model on one process (the real `cli.py fit`), and its export to a
    Hugging Face folder. Tests that change either work on a copy."""
    from gpt_tp.checkpoint.export import main as export_main

    tmp = tmp_path_factory.mktemp("demo_checkpoint")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(ROOT / "configs" / "cpu.yaml"),
                           "--trainer.logger", "false", "--trainer.devices", "1", "--trainer.strategy.init_args.tensor_parallel_size", "1",
                           "--trainer.max_steps", "1", "--data.val_batches", "0", "--model.total_batch_size", "null",
                           "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
                           "--trainer.callbacks.dirpath", str(tmp / "ckpt"), "--trainer.callbacks.save_last", "true"],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = tmp / "ckpt" / "last.ckpt"
    assert export_main([str(saved), "--out", str(tmp / "hf"), "--format", "hf"]) == 0
    return saved, tmp / "hf"


# ---- added for the fast-suite work on test_simulate, test_planner, test_scaling, test_bench, test_audit,
# test_paritycheck, test_hellaswag_score and test_malloc --------------------------------------------------------


@pytest.fixture
def command_here(monkeypatch, request):
    """Run a command's main in this process as its __main__ does (gpt_tp.entry.run), from the repository root, outside
    any process group; return its exit code, stdout and stderr as subprocess.run would (returncode, stdout, stderr).
    For a command's table or refusal, where a process of its own would add only its start-up; each command still
    runs once as `python -m ...` in its tests."""
    import lightning.pytorch  # noqa: F401  # before capsys: Lightning's log handlers keep the stderr of its import
    from gpt_tp.entry import run

    capsys = request.getfixturevalue("capsys")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["command"])
    for k in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)

    def go(main) -> SimpleNamespace:
        threads = torch.get_num_threads()
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run(main)
        torch.set_num_threads(threads)
        out = capsys.readouterr()
        return SimpleNamespace(returncode=e.value.code, stdout=out.out, stderr=out.err)

    return go


# ---- fast-c (tests/test_ac.py, test_tp_parity.py, test_ddp.py, test_io_faults.py, test_checkpoint.py, test_muon.py,
# test_multinode.py, test_slurm_ranks.py): expensive runs made once ------------------------------------------------
def lightning_fits(tmp_path, nproc: int, runs: dict[str, tuple[str, ...]]) -> dict[str, tuple[dict, dict]]:
    """Several runs of tests/workers/lightning_fit.py on the same nproc processes, one after another in one launch
    (each its own Trainer, seed and model, as in a process of its own): by name, its JSON record and saved parameters."""
    argv = []
    for name, args in runs.items():
        argv += [*(["--then"] if argv else []), "--out", str(tmp_path / name), *args]
    if nproc == 1:
        run_python("lightning_fit.py", *argv)
    else:
        run_torchrun("lightning_fit.py", nproc, *argv)
    return {name: (read_json(tmp_path / f"{name}.json"), torch.load(tmp_path / f"{name}.pt")) for name in runs}


# tests/workers/muon_parity.py's runs and parity.py's (`--worker parity`: the same module, so its runs of one layout
# share one mesh, as muon_parity's do), those of one group in one launch on its number of processes, made the first
# time a test asks for one of them (each run seeds and builds afresh): the quick group is `-m "not slow"`'s
PARITY = ("--worker", "parity")
PARITY_LAUNCHES = {
    "quick": (2, {"muon_tp2_bf16": ("--dp", "1"), "tp2": (*PARITY, "--dp", "1")}),
    "slow2": (2, {**{plan: (*PARITY, "--plan", f"benchmarks.plans:{plan}", "--skip-naive")
                     for plan in ("overlap3", "ordered", "dtensor", "torch_recipe")},
                  "muon_tp2_fp32": ("--dp", "1", "--fp32"), "muon_dp2xtp1_bf16": ("--dp", "2"),
                  "muon_dp2xtp1_fp32": ("--dp", "2", "--fp32")}),
    "slow4": (4, {"overlap2": (*PARITY, "--dp", "2", "--plan", "benchmarks.plans:overlap2", "--skip-naive"),
                  "muon_dp2xtp2_bf16": ("--dp", "2"), "muon_dp2xtp2_fp32": ("--dp", "2", "--fp32"),
                  "TP_PLAN": (*PARITY, "--dp", "2")}),  # last: its naive recipe ends in errors by design
}


@pytest.fixture(scope="session")
def parity_runs(tmp_path_factory):
    """parity_runs(group, name): each rank's JSON result of PARITY_LAUNCHES[group]'s run `name`."""
    done = {}

    def get(group: str, name: str) -> list[dict]:
        nproc, runs = PARITY_LAUNCHES[group]
        if group not in done:
            tmp, argv = tmp_path_factory.mktemp(f"parity_{group}"), []
            for run_name, args in runs.items():
                argv += [*(["--then"] if argv else []), *args, "--out", str(tmp / run_name)]
            run_torchrun("muon_parity.py", nproc, *argv)
            done[group] = {n: [read_json(tmp / f"{n}.{rank}.json") for rank in range(nproc)] for n in runs}
        return done[group][name]

    return get


# tests/workers/lightning_fit.py's runs of test_tp_parity.py, test_ac.py and test_ddp.py, those of one world size in one
# launch, made the first time a test asks for one of them (each its own Trainer, seed and model); a run two files
# compare against (`single`, `tp2`) is made once; eager runs before compiled ones. `*_g`: 2 steps with the
# gradient-reading callback.
GRADS, XL = ("--steps", "2", "--grads"), ("--dp", "2", "--compile", "--precision", "bf16-mixed")
LIGHTNING_LAUNCHES = {
    1: {"single": (), "single_g": GRADS},
    2: {"ddp": ("--dp", "2", "--strategy", "ddp"), "mp_dp2": ("--dp", "2"), "tp2": ("--tp", "2"),
        "ac_full": ("--tp", "2", "--ac", "full"), "tp2m": ("--tp", "2", "--init-module", "--precision", "bf16-mixed"),
        "tp2_g": (*GRADS, "--tp", "2"), "tp2c": ("--tp", "2", "--compile"),
        "ac_selc": ("--tp", "2", "--ac", "selective", "--compile"), "xl": XL, "xl_sel": (*XL, "--ac", "selective")},
    4: {"fsdp": ("--tp", "2", "--dp", "2"), "fsdp_sel": ("--tp", "2", "--dp", "2", "--ac", "selective"),
        "dp2tp2m": ("--tp", "2", "--dp", "2", "--meta"), "dp2tp2b": ("--tp", "2", "--dp", "2", "--precision", "bf16-mixed"),
        "dp2tp2_g": (*GRADS, "--tp", "2", "--dp", "2")},
}


@pytest.fixture(scope="session")
def lightning_runs(tmp_path_factory):
    """lightning_runs(nproc) -> (LIGHTNING_LAUNCHES[nproc]'s runs by name: its JSON record and saved parameters, the
    folder holding their files)."""
    done = {}

    def get(nproc: int) -> tuple[dict[str, tuple[dict, dict]], Path]:
        if nproc not in done:
            tmp = tmp_path_factory.mktemp(f"lightning{nproc}")
            done[nproc] = lightning_fits(tmp, nproc, LIGHTNING_LAUNCHES[nproc]), tmp
        return done[nproc]

    return get


# ---- trim (tests/test_lifecycle.py, test_user_paths.py, test_slurm.py, test_multinode.py, ...): a run two files make --
@pytest.fixture(scope="session")
def one_node_of_4(tmp_path_factory) -> dict:
    """tests/workers/multinode_fit.py as one node of 4 processes (DP=2 x TP=2): the record the two-node runs of
    tests/test_multinode.py and tests/test_slurm.py must equal, made once."""
    from test_multinode import launch_nodes

    return launch_nodes(1, 4, 2, tmp_path_factory.mktemp("one_node_of_4") / "one")
