"""Asynchronous checkpoint saves (trainer.strategy.init_args.async_save: true) through `python cli.py fit` at TP=2 on
configs/cpu.yaml's model: each rank's write slowed down (tests.workers.async_save.SlowWrite) so training runs on
while it is written. A save is committed (renamed into place, crc32.json, last.ckpt moved, the checkpoint it replaces
removed) only once every rank's write is done; the staged copy is the state at the step saved (a resume is
bit-identical to the uninterrupted run); a kill -9 or a full disk during the write leaves the previous checkpoint."""

import json
import os
import re
import shutil
import signal
import time

import pytest

from test_io_faults import CHECKPOINT_MIB, errors, fit, losses, tmpfs  # noqa: F401 - tmpfs: the fixture
from test_lifecycle import checkpointing, finished, fit as launch, step_of

from gpt_tp.checkpoint import check_checkpoint

ASYNC = ("--trainer.strategy.init_args.async_save", "true")
CHECKPOINTS = "gpt_tp.checkpoint.AtomicModelCheckpoint"


def slow(log, delay_s: float = 3.0, kill_at: int = -1, fail_at: int = -1) -> tuple[str, ...]:
    return ("--trainer.callbacks+=tests.workers.async_save.SlowWrite", "--trainer.callbacks.delay_s", str(delay_s),
            "--trainer.callbacks.record", str(log), "--trainer.callbacks.kill_at", str(kill_at),
            "--trainer.callbacks.fail_at", str(fail_at))


def seen(log) -> dict[int, dict]:
    """SlowWrite's log: by step, the checkpoint folder's entries and last.ckpt's target at that step's start."""
    return {s["step"]: s for s in map(json.loads, open(log))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The losses, by step, of the 9-step run saving synchronously every 3 steps."""
    tmp = tmp_path_factory.mktemp("sync")
    proc = fit(tmp, tmp / "ckpt", checkpoints=CHECKPOINTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(tmp, 0)


@pytest.mark.slow
def test_async_saves_commit_after_every_write_and_resume_exactly(tmp_path, uninterrupted):
    """Writes 3 s late: training goes on through them (the step-3 save is still a .partial folder, last.ckpt not yet
    moved, at the next step), the run trains the synchronous run's losses, ends with steps 6 and 9 committed and checked
    (CRC-32s) and last.ckpt -> step 9; step 6, whose write overlapped steps 7 and 8, resumes bit-identically."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "seen.jsonl"
    proc = fit(tmp_path, ckpt, *ASYNC, *slow(log), checkpoints=CHECKPOINTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path, 0) == uninterrupted
    at = seen(log)
    assert "step0000003.ckpt.partial" in at[3]["entries"] and at[3]["last"] is None  # in flight, not committed
    assert all(sum(e.endswith(".partial") for e in s["entries"]) <= 1 for s in at.values())  # at most one in flight
    assert sorted(os.listdir(ckpt)) == ["last.ckpt", "step0000006.ckpt", "step0000009.ckpt"]
    assert os.readlink(ckpt / "last.ckpt") == "step0000009.ckpt"
    for step in (6, 9):
        check_checkpoint(ckpt / f"step{step:07d}.ckpt", part=slice(None))  # every file's CRC-32 as its save recorded
    shutil.copytree(ckpt / "step0000006.ckpt", tmp_path / "kept" / "step0000006.ckpt")
    resumed = fit(tmp_path, tmp_path / "resumed", *ASYNC, "--ckpt_path", str(tmp_path / "kept" / "step0000006.ckpt"),
                  checkpoints=CHECKPOINTS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path, 1) == {k: uninterrupted[k] for k in range(6, 9)}


@pytest.mark.slow
def test_kill_during_async_write_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    """SIGKILL at step 7, while the step-6 save is being written: step 3 and last.ckpt -> step 3 are as they were,
    and `--ckpt_path last` resumes from step 3 bit-identically."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "seen.jsonl"
    killed = fit(tmp_path, ckpt, *ASYNC, *slow(log, kill_at=7), checkpoints=CHECKPOINTS, start_new_session=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert seen(log)[7]["entries"] == ["last.ckpt", "step0000003.ckpt", "step0000006.ckpt.partial"]
    assert os.readlink(ckpt / "last.ckpt") == "step0000003.ckpt"
    resumed = fit(tmp_path, ckpt, *ASYNC, "--ckpt_path", "last", checkpoints=CHECKPOINTS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path, 1) == {k: uninterrupted[k] for k in range(3, 9)}
    assert sorted(os.listdir(ckpt)) == ["last.ckpt", "step0000006.ckpt", "step0000009.ckpt"]
    assert os.readlink(ckpt / "last.ckpt") == "step0000009.ckpt"


@pytest.mark.slow
def test_full_disk_during_async_write_is_one_line(tmp_path, tmpfs):
    """80 MiB hold the step-3 checkpoint (50.4 MiB) but not step 6's: its background write fails, every rank stops at
    the next step boundary with the synchronous save's one line (exit code 2), and step 3 and last.ckpt -> step 3
    are as they were, no partial folder left."""
    fs = tmpfs("80m")
    full = fit(tmp_path, fs, *ASYNC, checkpoints=CHECKPOINTS)
    assert full.returncode == 2, full.stderr[-3000:]
    (line,) = errors(full)
    assert line.startswith(f"error: no space left to save step0000006.ckpt in {fs} (") and line.endswith(
        f" MiB free; a checkpoint needs about {CHECKPOINT_MIB} MiB): free space, lower save_top_k, or choose another dirpath; "
        "the checkpoints already there are intact (resume with --ckpt_path last)")
    assert "Traceback" not in full.stderr
    assert sorted(os.listdir(fs)) == ["last.ckpt", "step0000003.ckpt"]
    assert os.readlink(fs / "last.ckpt") == "step0000003.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "Ctrl-C"])
def test_sigterm_or_ctrl_c_waits_for_the_save_in_flight(tmp_path, sig, rc):
    """SIGTERM, or Ctrl-C (SIGINT to the process group, as a terminal sends it), while the step-3 save is being
    written (3 s late): the run saves the step reached, waits for both writes and commits them before it leaves
    (exit 143 / 130), the closing line naming that step."""
    ck, log = tmp_path / "ck", tmp_path / "seen.jsonl"
    proc = launch("--config", checkpointing(ck), "--trainer.max_steps", "400", *ASYNC, *slow(log),
                  start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (ck / "step0000003.ckpt.partial").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
        code, out = finished(proc, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == rc, out[-3000:]
    stop = re.search(rf"gpt_tp fit: stopped by {sig.name} at step (\d+); saved checkpoints in \S+ \(last\.ckpt -> "
                     r"(step\d+\.ckpt)\); resume with --ckpt_path last", out)
    assert stop, out[-3000:]
    step = int(stop[1])
    assert os.readlink(ck / "last.ckpt") == stop[2] and step_of(ck / "last.ckpt") == step > 3
    assert not list(ck.glob("*.partial"))
    for saved in ck.glob("step*.ckpt"):
        check_checkpoint(saved, part=slice(None))


@pytest.mark.slow
def test_an_error_while_a_save_is_in_flight_says_it_is_lost(tmp_path):
    """Every rank fails at step 3's start, the step-3 save still being written: one error line (exit 2) and one
    warning that the save is lost; nothing was committed, so no last.ckpt."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "seen.jsonl"
    proc = fit(tmp_path, ckpt, *ASYNC, *slow(log, fail_at=3), checkpoints=CHECKPOINTS)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors(proc) == ["error: injected failure at step 3"]
    assert proc.stderr.count(f"checkpoint {ckpt / 'step0000003.ckpt'} was still being written when the run stopped "
                             "with an error: it is lost; --ckpt_path last resumes from the newest committed checkpoint") == 1
    assert not (ckpt / "last.ckpt").exists() and not (ckpt / "step0000003.ckpt").exists()


def test_planner_and_simulate_count_the_staging_copy():
    """An asynchronous save's copy is the rank's weights and AdamW's two moments, fp32: GPT-2 124M's parameters x 12
    bytes at TP=1 (host memory, outside the device total); --simulate prints it."""
    import torch

    from gpt_tp.cli.simulate import KINDS, Simulation, format_simulation
    from gpt_tp.model import GPT, GPTConfig
    from gpt_tp.ranks import Layout
    from gpt_tp.sizing.memory import memory_per_device

    config = GPTConfig.from_name("gpt2")
    with torch.device("meta"):
        numel = sum(p.numel() for p in GPT(config).parameters())  # the tied wte/lm_head once, as the copy holds it
    m = memory_per_device(config, 1, 1, 4, 1024, precision="32-true")
    assert m.staging == 12 * numel and m.total == m.states + m.activations + m.transient + m.overhead
    planned = {**dict.fromkeys(KINDS, 0), "total": 0, "staging": m.staging}
    text = format_simulation(Simulation(Layout(1, 1), 0, "cpu", planned, planned, {}), None)
    assert (f"an asynchronous save (trainer.strategy.init_args.async_save) stages {12 * numel / 2**30:.2f} GiB per rank "
            "in host memory (pinned on CUDA), beside these") in text
