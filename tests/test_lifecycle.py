"""A run's lifecycle through the real `cli.py fit` (configs/cpu.yaml, TP=2, saving every 3 steps): its final step is
saved; SIGTERM to the process group or to one rank, under Lightning's own processes and under torchrun, saves the
step reached and stops every rank with exit code 143, and Ctrl-C does the same with 130; a rank killed with SIGKILL
leaves one line naming it; last.ckpt names this run's newest checkpoint in a fresh, a used and a copied folder (that a
fine-tune's checkpoint needs no init_from again: tests/test_user_paths.py's fine-tune); a damaged checkpoint is
refused in one line by every command. The launch mistakes run in this process."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cli  # imported here, not under capsys: Lightning's log handlers keep the stream they first see
from conftest import ROOT, one_error_line
from test_bad_inputs import CPU, ONE_DEVICE, cli_main, snapshot

from gpt_tp.cli import checks
from gpt_tp.cli.main import GPTCLI
from gpt_tp.errors import UserError


def checkpointing(dirpath: Path, *, every: int = 3) -> str:
    """A config file (JSON is YAML) replacing configs/cpu.yaml's callbacks: its ModelCheckpoint into dirpath only; steps
    of 2 sequences (what these tests show is the run's lifecycle, not the batch)."""
    path = dirpath.parent / f"{dirpath.name}.yaml"
    path.write_text(f"""{{"trainer": {{"logger": false, "enable_progress_bar": false, "callbacks": [
        {{"class_path": "gpt_tp.checkpoint.AtomicModelCheckpoint", "init_args": {{"dirpath": "{dirpath}",
          "filename": "step{{step:07d}}", "auto_insert_metric_name": false, "every_n_train_steps": {every},
          "save_top_k": 2, "monitor": "step", "mode": "max", "save_last": "link"}}}}]}},
        "data": {{"val_batches": 0, "batch_size": 2}}, "model": {{"total_batch_size": 256}}}}""")
    return str(path)


def fit(*args: str, launcher: tuple[str, ...] = (), **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *launcher, str(ROOT / "cli.py"), "fit", "--config", CPU, *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finished(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def step_of(path: Path) -> int:
    return torch.load(path / "meta.pt", weights_only=True)["global_step"]


def last_line(out: str) -> str:
    return [line for line in out.splitlines() if line.startswith("gpt_tp fit:")][-1]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> tuple[int, str, Path]:
    """One TP=2 run of 4 steps saving every 3 (steps 3 and 4, last.ckpt -> step 4): its exit code, output and folder.
    Tests that change the folder work on a copy."""
    ck = tmp_path_factory.mktemp("four_steps") / "ck"
    return *finished(fit("--config", checkpointing(ck), "--trainer.max_steps", "4")), ck


def copy_of(four_steps, to: Path) -> Path:
    shutil.copytree(four_steps[2], to, symlinks=True)
    return to


@pytest.mark.slow
def test_final_step_and_last_ckpt_in_fresh_used_and_copied_folders(tmp_path, four_steps, user_run):
    """4 steps saving every 3: step 4 is saved and last.ckpt names it. A fresh run into that folder is refused
    (nothing changed), a resume at max_steps is refused as complete (both refusals in this process: they come before
    any process group starts); resumes in the same and in a copied folder move last.ckpt to their own newest step
    with no -v1 files; --overwrite_checkpoints true starts again. Commands that neither write what the other reads
    run side by side (the copy's resume and the overwrite)."""
    rc, out, made = four_steps
    assert rc == 0, out[-3000:]
    assert last_line(out) == f"gpt_tp fit: step 4; checkpoints in {made} (last.ckpt -> step0000004.ckpt); no logger"
    ck = copy_of(four_steps, tmp_path / "ck")
    config = checkpointing(ck)
    assert sorted(os.listdir(ck)) == ["last.ckpt", "step0000003.ckpt", "step0000004.ckpt"]
    assert os.readlink(ck / "last.ckpt") == "step0000004.ckpt" and step_of(ck / "last.ckpt") == 4

    before = snapshot(ck)
    line = user_run(cli_main("fit", "--config", CPU, "--config", config, "--trainer.max_steps", "6"))
    assert line.startswith(f"error: ModelCheckpoint dirpath {ck} holds another run's checkpoints (last.ckpt, "
                           "step0000003.ckpt, step0000004.ckpt): continue that run with --ckpt_path last"), line
    line = user_run(cli_main("fit", "--config", CPU, "--config", config, "--ckpt_path", "last", "--trainer.max_steps", "4"))
    assert line == (f"error: --ckpt_path last: the run is already complete ({ck}/last.ckpt is at step 4 >= "
                    "trainer.max_steps 4); raise --trainer.max_steps to train further")
    assert snapshot(ck) == before

    rc, out = finished(fit("--config", config, "--ckpt_path", "last", "--trainer.max_steps", "7"))
    assert rc == 0, out[-3000:]
    assert sorted(os.listdir(ck)) == ["last.ckpt", "step0000006.ckpt", "step0000007.ckpt"]  # the newest 2 + last
    assert os.readlink(ck / "last.ckpt") == "step0000007.ckpt" and step_of(ck / "last.ckpt") == 7

    copy = tmp_path / "copy"
    shutil.copytree(ck, copy, symlinks=True)
    resumed = fit("--config", checkpointing(copy), "--ckpt_path", "last", "--trainer.max_steps", "8")
    again = fit("--config", config, "--trainer.max_steps", "2", "--overwrite_checkpoints", "true")
    rc, out = finished(resumed)
    assert rc == 0, out[-3000:]
    assert sorted(os.listdir(copy)) == ["last.ckpt", "step0000007.ckpt", "step0000008.ckpt"], os.listdir(copy)
    assert last_line(out).startswith(f"gpt_tp fit: step 8; checkpoints in {copy} (last.ckpt -> step0000008.ckpt)")

    rc, out = finished(again)
    assert rc == 0, out[-3000:]
    assert sorted(os.listdir(ck)) == ["last.ckpt", "step0000002.ckpt"] and step_of(ck / "last.ckpt") == 2
    assert out.count(f"gpt_tp: --overwrite_checkpoints removed last.ckpt, step0000006.ckpt, step0000007.ckpt from {ck}") == 1


def test_overwrite_checkpoints_says_what_it_removed(tmp_path, caplog):
    """--overwrite_checkpoints's deletion (every rank's cli.py may run it): one line per folder naming what went."""
    (tmp_path / "a.ckpt").mkdir()
    (tmp_path / "b.ckpt").write_bytes(b"x")
    (tmp_path / "keep.txt").write_text("mine")
    with caplog.at_level("INFO"):
        checks.remove_checkpoints({str(tmp_path), str(tmp_path / "empty")})
    assert os.listdir(tmp_path) == ["keep.txt"]
    assert [r.getMessage() for r in caplog.records] == [f"gpt_tp: --overwrite_checkpoints removed a.ckpt, b.ckpt from {tmp_path}"]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
@pytest.mark.real_interpreter  # it finds the ranks with ps --ppid and pgrep -s, which see a zygote child's client only
@pytest.mark.parametrize("launch, target", [("lightning", "group"), ("lightning", "rank0"), ("lightning", "rank1"),
                                            ("torchrun", "group")])
def test_sigterm_saves_the_step_reached_and_stops_every_rank(tmp_path, launch, target):
    """SIGTERM after the step-3 save, to the process group (timeout, docker stop, systemd) or to one rank: every rank
    stops within seconds at one step, which is saved with last.ckpt naming it; the closing line says so; every rank
    exits 143."""
    ck = tmp_path / "ck"
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2") if launch == "torchrun" else ()
    proc = fit("--config", checkpointing(ck), "--trainer.max_steps", "400", launcher=launcher, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (ck / "step0000003.ckpt" / "meta.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.5)
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid if target == "rank0" else _children(proc.pid)[0], signal.SIGTERM)
        sent = time.monotonic()
        rc, out = finished(proc, timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # torchrun's agent ends with its own SignalException (exit 1) once its workers, which exit 143, are gone
    assert rc == (1 if launch == "torchrun" else 143), out[-3000:]
    stop = re.search(r"gpt_tp fit: stopped by SIGTERM at step (\d+); saved checkpoints in (\S+) \(last\.ckpt -> "
                     r"(step\d+\.ckpt)\); resume with --ckpt_path last", out)
    assert stop, out[-3000:]
    step = int(stop[1])
    print(f"SIGTERM {launch}/{target}: the command ended {took:.1f} s after the signal, at step {step}")  # a figure
    assert step > 3 and stop[2] == str(ck) and stop[3] == f"step{step:07d}.ckpt"
    assert os.readlink(ck / "last.ckpt") == stop[3] and step_of(ck / "last.ckpt") == step
    assert sorted(re.findall(r"rank (\d): checkpoint saved after SIGTERM: exiting", out)) == ["0", "1"], out[-3000:]
    assert "Received SIGTERM" not in out  # Lightning's handler (a broadcast inside it) never ran
    left = time.monotonic() + 10  # every rank ends: none is left in the session (rank 1 may outlive rank 0 briefly)
    while subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout and time.monotonic() < left:
        time.sleep(0.2)
    assert subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout == b""


@pytest.mark.slow
def test_ctrl_c_saves_the_step_reached_and_a_second_one_keeps_the_checkpoints(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) after the step-5 save: the step reached is saved as
    after SIGTERM, with the same closing line, and every rank exits 130; a second Ctrl-C as that save's partial folder
    appears changes nothing: the save completes and step 5's checkpoint is as it was."""
    ck = tmp_path / "ck"
    proc = fit("--config", checkpointing(ck, every=5), "--trainer.max_steps", "400", start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (ck / "step0000005.ckpt" / "meta.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        kept = snapshot(ck / "step0000005.ckpt")
        os.killpg(proc.pid, signal.SIGINT)
        while not list(ck.glob("*.partial")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        during = bool(list(ck.glob("*.partial")))
        os.killpg(proc.pid, signal.SIGINT)
        rc, out = finished(proc, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 130, out[-3000:]
    stop = re.search(r"gpt_tp fit: stopped by SIGINT at step (\d+); saved checkpoints in (\S+) \(last\.ckpt -> "
                     r"(step\d+\.ckpt)\); resume with --ckpt_path last", out)
    assert stop, out[-3000:]
    step = int(stop[1])
    print(f"Ctrl-C: stopped at step {step}; the second Ctrl-C came {'during' if during else 'after'} the save")
    assert 5 < step < 10 and stop[2] == str(ck) and stop[3] == f"step{step:07d}.ckpt"
    assert os.readlink(ck / "last.ckpt") == stop[3] and step_of(ck / "last.ckpt") == step
    assert snapshot(ck / "step0000005.ckpt") == kept
    assert sorted(re.findall(r"rank (\d): checkpoint saved after SIGINT: exiting", out)) == ["0", "1"], out[-3000:]
    assert "KeyboardInterrupt" not in out and "Traceback" not in out and "graceful shutdown" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.real_interpreter  # it finds rank 1 with ps --ppid
def test_a_rank_killed_leaves_one_line_naming_it(tmp_path):
    """SIGKILL to rank 1 (a kill -9, the kernel's OOM killer) after the step-3 save: rank 0's next collective fails, and
    instead of gloo's traceback it prints one line naming rank 1 and how it ended, and exits with code 75."""
    ck = tmp_path / "ck"
    proc = fit("--config", checkpointing(ck), "--trainer.max_steps", "400", start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (ck / "step0000003.ckpt" / "meta.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        os.kill(_children(proc.pid)[0], signal.SIGKILL)
        rc, out = finished(proc, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 75, out[-3000:]
    lines = [line for line in out.splitlines() if "collective failed" in line]
    assert len(lines) == 1 and re.fullmatch(
        r"\[gpt_tp\] rank 0: a collective failed at step \d+: rank 1 died \(killed by SIGKILL\) \(\w+: .*\)\. "
        r"Exiting with code 75; see the other ranks' logs, then resume from the latest checkpoint\.", lines[0]), out[-3000:]
    assert "Traceback" not in out and "Connection closed" not in out.replace(lines[0], ""), out[-3000:]


# ---- launch mistakes: one line before anything waits (in this process) ---------------------------------------------
def test_slurm_allocation_of_another_size(user_run, monkeypatch):
    for k, v in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
                 "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1"}.items():
        monkeypatch.setenv(k, v)
    line = user_run(cli_main("fit", "--config", CPU, "--trainer.logger", "false"))
    assert line == ("error: this Slurm allocation runs 1 task(s), but the config trains on trainer.devices=2 x "
                    "trainer.num_nodes=1 = 2 processes: allocate --nodes=1 --ntasks-per-node=2 (sbatch/srun), or set "
                    "trainer.devices and trainer.num_nodes to the allocation")


def test_stray_torchrun_variables(user_run, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(checks, "RENDEZVOUS_TIMEOUT_S", 1.0)
    monkeypatch.setattr("gpt_tp.entry._leave", sys.exit)  # with RANK set it would os._exit this test process
    stray = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "old",
             "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for k, v in stray.items():
        monkeypatch.setenv(k, v)
    line = user_run(cli_main("fit", "--config", CPU, "--trainer.logger", "false"))
    names = "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID " \
            "TORCHELASTIC_USE_AGENT_STORE"
    assert line == (f"error: nothing answers the rendezvous at 127.0.0.1:{port} after 1 s: this shell holds torchrun's "
                    f"variables ({names}), left by an earlier job? `unset {names}` and run again, or start the run "
                    "under torchrun")


def test_lightning_launcher_on_a_node_started_first_does_not_probe(monkeypatch):
    """Lightning's launcher without Slurm or torchrun: node 1's processes hold LOCAL_RANK, NODE_RANK, WORLD_SIZE and
    MASTER_* but no RANK; with node 0 not yet up they go on to the process group (which waits for it) rather than
    blame torchrun's variables. A shell that holds RANK is still asked (test_stray_torchrun_variables)."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.environments import LightningEnvironment

    with socket.socket() as s:  # node 0's port, where nothing listens yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(checks, "RENDEZVOUS_TIMEOUT_S", 1.0)
    monkeypatch.delenv("RANK", raising=False)
    for k, v in {"LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    trainer = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=LightningEnvironment()), num_devices=2,
                              num_nodes=2)
    checks.check_launch(trainer)  # returns: no UserError naming torchrun's variables
    monkeypatch.setenv("RANK", "3")  # the same shell with torchrun's RANK: asked, and refused
    with pytest.raises(UserError, match="nothing answers the rendezvous"):
        checks.check_launch(trainer)


def test_callback_list_that_replaced_the_checkpoint(user_run, tmp_path, monkeypatch):
    """jsonargparse replaces a whole list: a trainer.callbacks with no ModelCheckpoint, from a second --config or the
    command line, drops configs/cpu.yaml's and is refused before launch; `callbacks+:` adds to the list instead."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("trainer:\n  callbacks:\n  - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n")
    layout = ("--trainer.logger", "false", "--trainer.devices", "1", "--trainer.strategy.init_args.tensor_parallel_size", "1")
    refused = ("error: trainer.callbacks has no ModelCheckpoint: the last trainer.callbacks given (a --config file's list, "
               "or the command line's) replaces the whole list (jsonargparse's rule)")
    line = user_run(cli_main("fit", "--config", CPU, "--config", str(mine), *layout))
    assert line.startswith(refused) and "`callbacks+:`" in line, line
    line = user_run(cli_main("fit", "--config", CPU, *layout, "--trainer.callbacks", "lightning.pytorch.callbacks.LearningRateMonitor"))
    assert line.startswith(refused), line
    mine.write_text("trainer:\n  callbacks+:\n  - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n")
    monkeypatch.chdir(ROOT)
    kept = GPTCLI(args=["--config", CPU, "--config", str(mine), *layout[:4], "--trainer.strategy", "auto"], run=False)
    checks.check_checkpoint_listed(kept.listed_callbacks, kept.trainer)  # appended: cpu.yaml's list, its checkpoint kept
    assert [type(c).__name__ for c in kept.trainer.checkpoint_callbacks] == ["AtomicModelCheckpoint"]
    assert type(kept.listed_callbacks[-1]).__name__ == "LearningRateMonitor"


@pytest.mark.slow
def test_the_missing_checkpoint_advice_leads_to_a_run_that_resumes(user_run, tmp_path):
    """The refusal of a callback list with no ModelCheckpoint advises a checkpoint with a fixed dirpath and last.ckpt:
    followed as printed, the run saves there, says so, and `--ckpt_path last` resumes it. A checkpoint without a
    dirpath (Lightning's folder under the logs) is named in the closing line with no warning that its folder was
    removed, and `--ckpt_path last` with no dirpath to look in is refused in one line."""
    mine = ("--trainer.callbacks", "gpt_tp.train.malloc.HeapSplit")
    run = ("--trainer.logger", "false", "--trainer.devices", "1", "--trainer.strategy.init_args.tensor_parallel_size", "1",
           "--data.val_batches", "0",
           "--trainer.default_root_dir", str(tmp_path / "root"), "--trainer.enable_progress_bar", "false")
    line = user_run(cli_main("fit", "--config", CPU, *run, *mine))
    advice = re.search(r"or add (--trainer\.callbacks\+=\S+ .*?) \(a fixed folder", line)[1].split()
    assert advice[-4:] == ["--trainer.callbacks.dirpath", "checkpoints/run", "--trainer.callbacks.save_last", "link"]
    advice[-3] = str(tmp_path / "checkpoints" / "run")
    first = finished(fit(*run, *mine, *advice, "--trainer.max_steps", "2"))
    again = finished(fit(*run, *mine, *advice, "--trainer.max_steps", "3", "--ckpt_path", "last"))
    for code, out in (first, again):
        assert code == 0 and "was removed during the run" not in out and "starting from step 0" not in out, out[-3000:]
    ckpt = tmp_path / "checkpoints" / "run"
    assert last_line(again[1]).startswith(f"gpt_tp fit: step 3; checkpoints in {ckpt} (last.ckpt -> ")
    assert step_of(ckpt / "last.ckpt") == 3
    plain = ("--trainer.callbacks+=gpt_tp.checkpoint.AtomicModelCheckpoint",)
    code, out = finished(fit(*run, *mine, *plain, "--trainer.max_steps", "1"))
    assert code == 0 and "was removed during the run" not in out, out[-3000:]
    assert last_line(out) == (f"gpt_tp fit: step 1; checkpoints in {tmp_path / 'root' / 'checkpoints'} "
                              "(epoch=1-step=1.ckpt); no logger")
    line = user_run(cli_main("fit", "--config", CPU, *run, *mine, *plain, "--ckpt_path", "last"))
    assert line == ("error: --ckpt_path last: no ModelCheckpoint has a dirpath, so there is no folder to find last.ckpt "
                    "in; set its dirpath (--trainer.callbacks.dirpath checkpoints/run after the --trainer.callbacks+= "
                    "that adds it), or give --ckpt_path a checkpoint folder")


def test_fresh_run_into_a_used_folder_and_a_complete_run(user_run, ckpt, tmp_path):
    """In this process, on the 1-step checkpoint: a fresh run into its folder, and a resume with max_steps 1."""
    saved, _ = ckpt
    used = tmp_path / "used"
    shutil.copytree(saved.parent, used, symlinks=True)
    before = snapshot(used)
    flags = (*ONE_DEVICE[:2], *ONE_DEVICE[4:], "--trainer.callbacks", "gpt_tp.checkpoint.AtomicModelCheckpoint",
             "--trainer.callbacks.dirpath", str(used))
    line = user_run(cli_main("fit", "--config", CPU, *flags))
    assert line == (f"error: ModelCheckpoint dirpath {used} holds another run's checkpoints (last.ckpt): continue that "
                    "run with --ckpt_path last, set another dirpath, or pass --overwrite_checkpoints true to delete them "
                    "and start from step 0")
    line = user_run(cli_main("fit", "--config", CPU, *flags, "--ckpt_path", "last", "--trainer.max_steps", "1"))
    assert line == (f"error: --ckpt_path last: the run is already complete ({used}/last.ckpt is at step 1 >= "
                    "trainer.max_steps 1); raise --trainer.max_steps to train further")
    assert snapshot(used) == before


@pytest.mark.slow
def test_damaged_checkpoint_is_refused_in_one_line_by_every_command(tmp_path, four_steps, command_here):
    """The TP=2 run's steps 3 and 4 (the four_steps fixture); a copy of its folder with step 4's rank-1 shard cut
    short, and one with 20 kB of rank 0's overwritten at the same size. fit --ckpt_path last (TP=2), validate (TP=2),
    predict (one process) and export each refuse it in one line naming the file and step 3, the newest intact
    checkpoint beside it, and change nothing."""
    from gpt_tp.checkpoint.export import main as export_main

    assert four_steps[0] == 0, four_steps[1][-3000:]
    cut, over = copy_of(four_steps, tmp_path / "cut"), copy_of(four_steps, tmp_path / "over")
    shard = cut / "step0000004.ckpt" / "__1_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size - 1000)
    with open(over / "step0000004.ckpt" / "__0_0.distcp", "r+b") as f:
        f.seek(size // 3)
        f.write(os.urandom(20_000))
    before = {d: snapshot(d) for d in (cut, over)}
    short = (f"error: checkpoint {cut}/last.ckpt is damaged: {cut}/last.ckpt/__1_0.distcp is cut short ({size - 1000} "
             f"bytes; its .metadata needs {size}); the newest intact checkpoint beside it is {cut}/step0000003.ckpt")
    changed = (f"error: checkpoint {over}/step0000004.ckpt is damaged: {over}/step0000004.ckpt/__0_0.distcp does not "
               f"match the CRC-32 its save recorded; the newest intact checkpoint beside it is {over}/step0000003.ckpt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def cli_run(*args: str) -> str:  # the CRC-32s are read where the shards load: after launch, on each rank
        proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        return one_error_line(proc)

    assert cli_run("fit", "--config", CPU, "--config", checkpointing(cut), "--ckpt_path", "last",
                   "--trainer.max_steps", "6") == short
    tp2 = ("--trainer.logger", "false", "--trainer.callbacks", "[]")
    assert cli_run("validate", "--config", CPU, *tp2, "--ckpt_path", f"{over}/step0000004.ckpt") == changed
    assert cli_run("predict", "--config", CPU, *ONE_DEVICE, "--ckpt_path", f"{over}/step0000004.ckpt",
                   "--prompt", "ROMEO:", "--max_new_tokens", "2") == changed
    for path, line in ((f"{cut}/last.ckpt", short), (f"{over}/step0000004.ckpt", changed)):
        proc = command_here(lambda: export_main([path, "--out", str(tmp_path / "hf")]))
        assert one_error_line(proc) == line
    assert {d: snapshot(d) for d in (cut, over)} == before and not (tmp_path / "hf").exists()
