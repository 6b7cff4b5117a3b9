"""I/O faults on real file systems, through `python cli.py fit` at TP=2: a checkpoint folder on a small tmpfs the
test mounts (root only: CI runs as root; elsewhere these skip with the reason), made read-only or removed mid-run.
Each fault gives one `error:` line (or one warning), every rank stops alike, the checkpoints already written stay
intact, no partial folder is left, and the newest complete checkpoint resumes bit-identically."""

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

CPU = str(ROOT / "configs" / "cpu.yaml")
CHECKPOINT_MIB = 50.4  # gpt_tp.sizing.sizes.checkpoint_bytes of cpu.yaml's model


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(size: str):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (CI runs as root)")
        d = tmp_path / f"fs{size}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fit(tmp_path, dirpath, *args, logs=None, checkpoints="lightning.pytorch.callbacks.ModelCheckpoint", **kwargs):
    """configs/cpu.yaml at TP=2 for 9 steps of 2 sequences, a checkpoint every 3 into dirpath (2 kept, last.ckpt a
    link), metrics into `logs` (default tmp_path/logs) through gpt_tp's HeldCSVLogger."""
    (tmp_path / "run.yaml").write_text(f"""
trainer:
  max_steps: 9
  val_check_interval: 3
  log_every_n_steps: 1
  logger:
  - class_path: gpt_tp.train.logs.HeldCSVLogger
    init_args: {{save_dir: {logs or tmp_path / "logs"}, name: run}}
  callbacks:
  - class_path: {checkpoints}
    init_args: {{dirpath: {dirpath}, filename: "step{{step:07d}}", auto_insert_metric_name: false, every_n_train_steps: 3,
                save_top_k: 2, monitor: step, mode: max, save_last: link}}
data:
  val_batches: 2
  batch_size: 2   # 256-token steps: what these tests show is the I/O, not the batch
model:
  total_batch_size: 256
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), "fit", "--config", CPU, "--config", str(tmp_path / "run.yaml"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def removed_folder_run(tmp_path_factory):
    """The 9-step run whose checkpoint folder is deleted after step 4 (test_removed_folder_mid_run_is_made_again):
    (the process, the folder, its losses by step)."""
    tmp = tmp_path_factory.mktemp("removed_folder")
    ckpt = tmp / "ckpt"
    proc = fit(tmp, ckpt, "--trainer.callbacks+=tests.workers.io_faults.BreakFolder", "--trainer.callbacks.path", str(ckpt),
               "--trainer.callbacks.step", "4", "--trainer.callbacks.how", "remove")
    return proc, ckpt, losses(tmp, 0) if proc.returncode == 0 else None


@pytest.fixture(scope="module")
def uninterrupted(removed_folder_run) -> dict[int, float]:
    """The losses of the 9-step run no fault of training touches, by step: the removed-folder run's (deleting the
    checkpoint folder between steps changes no training state; a run it disturbed would fail every comparison)."""
    proc, _, run_losses = removed_folder_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(run_losses) == list(range(9))
    return run_losses


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def losses(tmp_path, version: int) -> dict[int, float]:
    rows = csv.DictReader(open(tmp_path / "logs" / "run" / f"version_{version}" / "metrics.csv"))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def test_no_room_for_one_checkpoint_is_refused_before_launch(user_run, tmpfs):
    import cli

    fs = tmpfs("30m")
    line = user_run(lambda: cli.main(["fit", "--config", CPU, "--trainer.logger", "false", "--trainer.devices", "1",
                                      "--trainer.strategy.init_args.tensor_parallel_size", "1",
                                      "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
                                      "--trainer.callbacks.dirpath", str(fs)]))
    assert line == (f"error: ModelCheckpoint dirpath: {fs} has 30.0 MiB free, but a checkpoint of this model needs about "
                    f"{CHECKPOINT_MIB} MiB; free space or choose another dirpath")
    assert os.listdir(fs) == []


@pytest.mark.slow
def test_full_disk_mid_save_stops_every_rank_and_resumes_exactly(tmp_path, tmpfs, uninterrupted):
    """80 MiB hold the step-3 checkpoint (50.4 MiB) but not step 6's as well: the run warns before launch, stops at
    the step-6 save with one line naming the folder, the free and the needed bytes and the fixes (exit code 2), and
    leaves step 3 and last.ckpt -> step 3 as they were. Step 3 resumed elsewhere gives the uninterrupted run's losses."""
    fs = tmpfs("80m")
    full = fit(tmp_path, fs)
    assert full.returncode == 2, full.stderr[-3000:]
    assert f"checkpoint folder {fs}: 80.0 MiB free, room for fewer than two checkpoints of {CHECKPOINT_MIB} MiB" in full.stderr
    (line,) = errors(full)
    assert line.startswith(f"error: no space left to save step0000006.ckpt in {fs} (") and line.endswith(
        f" MiB free; a checkpoint needs about {CHECKPOINT_MIB} MiB): free space, lower save_top_k, or choose another dirpath; "
        "the checkpoints already there are intact (resume with --ckpt_path last)")
    assert "Traceback" not in full.stderr
    assert sorted(os.listdir(fs)) == ["last.ckpt", "step0000003.ckpt"]  # no partial folder
    assert os.readlink(fs / "last.ckpt") == "step0000003.ckpt"
    shutil.copytree(fs / "step0000003.ckpt", tmp_path / "kept" / "step0000003.ckpt")
    resumed = fit(tmp_path, tmp_path / "resumed", "--ckpt_path", str(tmp_path / "kept" / "step0000003.ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before, after = losses(tmp_path, 0), losses(tmp_path, 1)
    assert before == {k: uninterrupted[k] for k in range(5)}  # step 5 ends in the failed save, before its row
    assert after == {k: uninterrupted[k] for k in range(3, 9)}  # bit-identical from the kept checkpoint


@pytest.mark.slow
def test_read_only_folder_mid_run_is_one_line(tmp_path, tmpfs, uninterrupted):
    """The checkpoint folder's file system turns read-only after step 4: the step-6 save stops every rank with one
    line naming the folder and the errno; step 3 stays intact and resumes bit-identically."""
    fs = tmpfs("200m")
    proc = fit(tmp_path, fs, "--trainer.callbacks+=tests.workers.io_faults.BreakFolder", "--trainer.callbacks.path", str(fs),
               "--trainer.callbacks.step", "4", "--trainer.callbacks.how", "read-only")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = errors(proc)
    assert line.startswith(f"error: ") and "Read-only file system" in line and str(fs) in line, line
    assert line.endswith("fix the storage (space, permissions) and resume from the last checkpoint")
    assert sorted(os.listdir(fs)) == ["last.ckpt", "step0000003.ckpt"]
    resumed = fit(tmp_path, tmp_path / "resumed", "--ckpt_path", str(fs / "step0000003.ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path, 1) == {k: uninterrupted[k] for k in range(3, 9)}


@pytest.mark.slow
def test_removed_folder_mid_run_is_made_again(removed_folder_run):
    """The checkpoint folder deleted after step 4: the step-6 save says so in one warning, makes it again and the
    run goes on to step 9; nothing else is lost. (Its losses are the reference of the resumed runs here.)"""
    proc, ckpt, _ = removed_folder_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"checkpoint folder {ckpt} was removed during the run: making it again") == 1
    assert sorted(os.listdir(ckpt)) == ["last.ckpt", "step0000006.ckpt", "step0000009.ckpt"]


@pytest.mark.slow
def test_kill_while_last_ckpt_moves(tmp_path, uninterrupted):
    """SIGKILL at the moment last.ckpt's new link is made, after the step-6 save. gpt_tp's ModelCheckpoint (the
    configs') makes the new link beside the old one and renames it over it: last.ckpt still names step 3, and
    `--ckpt_path last` resumes from step 3 bit-identically."""
    ckpt = tmp_path / "ckpt"
    checkpoints = "gpt_tp.checkpoint.AtomicModelCheckpoint"
    killed = fit(tmp_path, ckpt, "--trainer.callbacks+=tests.workers.io_faults.KillAtRelink", "--trainer.callbacks.step", "6",
                 checkpoints=checkpoints, start_new_session=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.ckpt", "step0000003.ckpt", "step0000006.ckpt"]
    assert os.readlink(ckpt / "last.ckpt") == "step0000003.ckpt"
    resumed = fit(tmp_path, ckpt, "--ckpt_path", "last", checkpoints=checkpoints)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path, 1) == {k: uninterrupted[k] for k in range(3, 9)}
    assert os.readlink(ckpt / "last.ckpt") == "step0000009.ckpt"


def test_missing_last_ckpt_is_linked_again(tmp_path, capsys):
    """What Lightning's own ModelCheckpoint leaves after a kill between deleting last.ckpt and linking it again:
    complete checkpoints and no last.ckpt. cli.py's relink_last (run before `--ckpt_path last` resolves) links it
    to the newest complete one and says so; an unfinished save (no meta.pt) is passed over."""
    from gpt_tp.checkpoint.last import relink_last

    for name, complete in (("step0000003.ckpt", True), ("step0000006.ckpt", True), ("step0000009.ckpt", False)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "meta.pt").write_bytes(b"x")
    relink_last({str(tmp_path)})
    assert os.readlink(tmp_path / "last.ckpt") == "step0000006.ckpt"
    assert capsys.readouterr().err == (f"gpt_tp: {tmp_path} had no last.ckpt (a run killed while moving it): linked it "
                                       "to step0000006.ckpt\n")


@pytest.mark.slow
def test_failed_metrics_csv_write_stops_every_rank_alike(tmp_path, tmpfs, uninterrupted):
    """Rank 0 alone writes metrics.csv; its file system turns read-only after step 4. Every rank stops at the next
    step with the same one line naming the file (no rank dies in a collective: no gloo "Connection closed", no
    traceback), and the newest checkpoint (on another disk) resumes bit-identically."""
    fs = tmpfs("4m")
    ckpt = tmp_path / "ckpt"
    broken = fit(tmp_path, ckpt, "--trainer.callbacks+=tests.workers.io_faults.BreakFolder", "--trainer.callbacks.path",
                 str(fs), "--trainer.callbacks.step", "4", "--trainer.callbacks.how", "read-only", logs=fs)
    assert broken.returncode == 2, broken.stderr[-3000:]
    (line,) = errors(broken)
    assert line == (f"error: Read-only file system while writing {fs}/run/version_0/metrics.csv; remount it read-write, "
                    "or write to another folder")
    assert "Traceback" not in broken.stderr and "Connection closed" not in broken.stderr
    assert sorted(os.listdir(ckpt)) == ["last.ckpt", "step0000003.ckpt"]
    resumed = fit(tmp_path, ckpt, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path, 0) == {k: uninterrupted[k] for k in range(3, 9)}


@pytest.mark.slow
def test_failed_tensorboard_write_stops_every_rank_alike(tmp_path, tmpfs):
    """The same with TensorBoard, whose writer thread fails first: no thread traceback, one line naming the event file."""
    fs = tmpfs("4m")
    broken = fit(tmp_path, tmp_path / "ckpt", "--trainer.logger", "gpt_tp.train.logs.HeldTensorBoardLogger",
                 "--trainer.logger.save_dir", str(fs), "--trainer.callbacks+=tests.workers.io_faults.BreakFolder",
                 "--trainer.callbacks.path", str(fs),
                 "--trainer.callbacks.step", "4", "--trainer.callbacks.how", "read-only")
    assert broken.returncode == 2, broken.stderr[-3000:]
    (line,) = errors(broken)
    assert line.startswith(f"error: Read-only file system while writing {fs}/lightning_logs/version_0/events.out.tfevents.")
    assert "Traceback" not in broken.stderr and "Connection closed" not in broken.stderr


@pytest.mark.slow
def test_failed_samples_write_stops_every_rank_alike(tmp_path, tmpfs):
    """TextSampleCallback's samples.txt (rank 0 writes it, gpt_tp.collective.one_does shares the outcome) on a file
    system turned read-only: every rank stops with the one line naming it."""
    fs = tmpfs("4m")
    broken = fit(tmp_path, tmp_path / "ckpt", "--trainer.callbacks+=tests.workers.io_faults.BreakFolder", "--trainer.callbacks.path",
                 str(fs), "--trainer.callbacks.step", "4", "--trainer.callbacks.how", "read-only",
                 "--trainer.callbacks+=gpt_tp.infer.sampling.TextSampleCallback", "--trainer.callbacks.every_n_steps", "4", logs=fs)
    assert broken.returncode == 2, broken.stderr[-3000:]
    (line,) = errors(broken)
    assert line == (f"error: Read-only file system while writing {fs}/run/version_0/samples.txt; remount it read-write, "
                    "or write to another folder")
    assert "Traceback" not in broken.stderr and "Connection closed" not in broken.stderr


# ---- single-process writers: prepare's shards, HellaSwag's download, export -----------------------------------------
def test_prepare_on_a_full_disk_then_resumes(user_run, tmpfs, tmp_path):
    """prepare fills a 48 KiB tmpfs: one line, no half-written shard or state file, every shard on disk complete;
    with more room the same command finishes, byte for byte the shards of a run that never ran out."""
    from gpt_tp.data import prepare as prep

    text = (ROOT / "tests" / "fixtures" / "hellaswag_small.jsonl").read_text() * 60
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": line}) + "\n" for line in text.splitlines()))
    args = ["--local", str(src), "--shard-size", "2000", "--workers", "1", "--quiet"]
    fs = tmpfs("48k")
    line = user_run(lambda: prep.main([*args, "--out", str(fs / "out")]))
    assert line.startswith("error: No space left on device while writing ") and line.endswith(
        "; free space (or the quota), or write to another folder"), line
    left = sorted(os.listdir(fs / "out"))
    assert not [f for f in left if f.endswith(".tmp")] and len(left) > 1
    state = json.loads((fs / "out" / "docs_prepare.json").read_text())
    npys = [f for f in left if f.endswith(".npy")]
    assert state["complete"] is False and {s["file"] for s in state["shards"]} <= set(npys)
    for f in npys:  # each shard on disk is whole (written to .tmp, then renamed); the state lists those it finished
        assert len(np.load(fs / "out" / f)) == 2000
    subprocess.run(["mount", "-o", "remount,size=4m", str(fs)], check=True)
    prep.main([*args, "--out", str(fs / "out")])  # the same command, with room now: resumes after the listed shards
    prep.main([*args, "--out", str(tmp_path / "ref")])
    done, ref = (json.loads((d / "docs_prepare.json").read_text()) for d in (fs / "out", tmp_path / "ref"))
    assert done["complete"] and done["shards"] == ref["shards"] and len(ref["shards"]) > len(state["shards"])
    for s in ref["shards"]:
        assert (fs / "out" / s["file"]).read_bytes() == (tmp_path / "ref" / s["file"]).read_bytes()


def test_hellaswag_download_on_a_full_disk(user_run, tmpfs, monkeypatch):
    from gpt_tp.eval import hellaswag_data as hd

    fs = tmpfs("64k")
    monkeypatch.setattr(hd, "fetch_url", lambda url, timeout=60.0: b"{}\n" * 100_000)  # 300 KB, more than the disk
    line = user_run(lambda: hd.resolve_path(None, fs / "hellaswag"))
    assert line == (f"error: No space left on device while writing {fs}/hellaswag/hellaswag_val.jsonl; free space (or the "
                    "quota), or write to another folder")
    assert os.listdir(fs / "hellaswag") == []  # no partial download


def test_export_on_a_full_disk_leaves_nothing(user_run, tmpfs, ckpt):
    from gpt_tp.checkpoint.export import main as export_main

    fs = tmpfs("8m")  # the checkpoint's weights alone are 13 MB
    line = user_run(lambda: export_main([str(ckpt[0]), "--out", str(fs / "export")]))
    assert line == f"error: --out {fs}/export: no space left on its device; free space or choose another --out"
    assert os.listdir(fs) == []


def test_plot_onto_a_read_only_disk(user_run, tmpfs, tmp_path):
    from gpt_tp.train.plot import main as plot_main

    run = tmp_path / "logs" / "gpt_tp" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("epoch,step,train/loss\n0,0,10.9\n0,1,9.8\n")
    fs = tmpfs("4m")
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    assert user_run(lambda: plot_main([str(run), "-o", str(fs / "run.png")])) == (
        f"error: Read-only file system while writing {fs}/run.png; remount it read-write, or write to another folder")
