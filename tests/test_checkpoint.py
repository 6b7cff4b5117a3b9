"""Distributed checkpoints on real gloo processes: exact resume, resharding, crash safety, export/import."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import cli  # imported here, not under capsys: Lightning's log handlers keep the stream they first see
from conftest import ROOT, WORKERS, read_json, run_python, run_torchrun
from torch.distributed.checkpoint import save as dcp_save

from gpt_tp.checkpoint import CheckpointError, check_checkpoint, load_consolidated, recover_interrupted_saves
from gpt_tp.checkpoint.store import PARTIAL, SUMS, check_intact, checksums, publish
from gpt_tp.errors import UserError
from gpt_tp.checkpoint.export import main as export_main


def fit(tmp, name, nproc=2, *args):
    return fits(tmp, nproc, {name: args})[name]


def fits(tmp, nproc: int, runs: dict[str, tuple[str, ...]]) -> dict[str, tuple[dict, str]]:
    """ckpt_fit.py's runs of one world size, one after another in one launch (each its own Trainer, data, seed and
    model; a resume never shares a launch with the run that saved its checkpoint): by name, (its losses by step, the
    checkpoint 'last' points to). Checkpoints go to tmp/ckpt_<name> unless the run's args give --ckpt-dir."""
    argv = []
    for name, args in runs.items():
        ckpt = () if "--ckpt-dir" in args else ("--ckpt-dir", str(tmp / f"ckpt_{name}"))
        argv += [*(["--then"] if argv else []), *ckpt, "--out", str(tmp / name), *args]
    if nproc == 1:
        run_python("ckpt_fit.py", *argv)
    else:
        run_torchrun("ckpt_fit.py", nproc, *argv)
    out = {}
    for name in runs:
        res = read_json(tmp / f"{name}.json")
        out[name] = {int(k): v for k, v in res["losses"].items()}, res["last"]
    return out


def run_to_failure(*args: str) -> subprocess.CompletedProcess:
    """ckpt_fit.py on 2 processes, expected to be killed or to fail: its output, without failing the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKERS / "ckpt_fit.py"), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0, proc.stderr[-4000:]
    return proc


def straight_runs(tmp, *args: str, also: dict[str, tuple[str, ...]] | None = None) -> tuple:
    """8 uninterrupted optimizer steps at TP=2, and a 4-step TP=2 run whose checkpoint the tests resume (ckpt_fit.py's
    `args` on both), in one launch with the TP=2 runs `also` (their results: fits' files in tmp): (tmp, the 8 steps'
    losses, the copied step-4 checkpoint)."""
    runs = fits(tmp, 2, {"full": ("--tp", "2", "--steps", "8", *args), "half": ("--tp", "2", "--steps", "4", *args), **(also or {})})
    losses, last = runs["full"]
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.5
    assert os.path.basename(last) == "step0008.ckpt"
    # every 2 steps, the last two kept, plus 'last'
    assert sorted(os.listdir(tmp / "ckpt_full")) == ["last.ckpt", "step0006.ckpt", "step0008.ckpt"]
    half, last = runs["half"]
    assert half == {k: losses[k] for k in range(1, 5)}
    saved = tmp / "step4_tp2"
    shutil.copytree(last, saved)
    return tmp, losses, saved


# the runs of test_kill_mid_save_then_resume_is_exact_with_dropout_and_accumulation and
# test_kill_between_the_renames_of_an_overwrite_keeps_the_name
KILL_ARGS = ("--tp", "2", "--steps", "6", "--dropout", "0.1", "--accum", "2", "--save-top-k", "-1")
ASIDE_ARGS = ("--tp", "2", "--steps", "6", "--save-last", "copy", "--no-version-counter")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """straight_runs, and in the same launch the uninterrupted KILL_ARGS run (`dropout_accum`)."""
    return straight_runs(tmp_path_factory.mktemp("straight"), also={"dropout_accum": KILL_ARGS})


def exact_resume_args(straight: tuple, tmp_path) -> tuple[str, ...]:
    """ckpt_fit.py's arguments of the exact resume: a copy of the 4-step run's folder, --resume last, to step 8."""
    ckpt_dir = tmp_path / "ckpt_resume"
    shutil.copytree(straight[0] / "ckpt_half", ckpt_dir, symlinks=True)
    return "--tp", "2", "--steps", "8", "--ckpt-dir", str(ckpt_dir), "--resume", "last"


def check_exact(losses: dict, resumed: dict) -> None:
    """The exact resume: steps 5-8 bit-identical in fp32 on CPU (model, optimizer state, LR schedule, step counters
    and the data position restored)."""
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == {k: losses[k] for k in range(5, 9)}


def check_resume_at(straight: tuple, tmp_path, layout: str, nproc: int, *args: str) -> None:
    """The step-4 TP=2 checkpoint continued at another layout: steps 5 and 6 within 1e-5."""
    _, losses, saved = straight
    resumed, _ = fit(tmp_path, layout, nproc, "--steps", "6", "--resume", str(saved), *args)
    check_resumed(losses, resumed)


def check_resumed(losses: dict, resumed: dict) -> None:
    assert sorted(resumed) == [5, 6]
    for k in (5, 6):
        assert resumed[k] == pytest.approx(losses[k], rel=1e-5, abs=0)


@pytest.fixture(scope="module")
def one_device(straight, tmp_path_factory):
    """One launch on one process: the step-4 TP=2 checkpoint resumed to step 6, and a fresh 4-step run whose
    checkpoint test_tp1_checkpoint_resumes_at_tp2 resumes at TP=2."""
    return fits(tmp_path_factory.mktemp("one_device"), 1, {"tp1": ("--steps", "6", "--resume", str(straight[2])),
                                                           "one": ("--steps", "4")})


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The two runs killed on purpose, a launch each: SIGKILL inside the step-4 save (KILL_ARGS), and right after the
    step-2 'last.ckpt' is moved aside to be overwritten at step 4 (ASIDE_ARGS). By name ("save", "aside"): (the
    launch's output, its checkpoint folder, a copy of that folder as the kill left it: the resume changes the folder)."""
    tmp = tmp_path_factory.mktemp("killed")
    out = {}
    for name, args, die in (("save", KILL_ARGS, ("--die-on-save", "2")), ("aside", ASIDE_ARGS, ("--die-on-aside", "1"))):
        ckpt_dir = tmp / f"ckpt_{name}"
        proc = run_to_failure(*args, *die, "--ckpt-dir", str(ckpt_dir), "--out", str(tmp / f"dead_{name}"))
        shutil.copytree(ckpt_dir, tmp / f"as_killed_{name}", symlinks=True)
        out[name] = proc, ckpt_dir, tmp / f"as_killed_{name}"
    return out


@pytest.fixture(scope="module")
def resumed(straight, one_device, killed, tmp_path_factory):
    """Every TP=2 and DP=2 resume of the tests below, one after another in one launch of 2 processes, each from a
    checkpoint saved in another launch: the 4-step run's folder with --resume last (`exact`), its step-4 checkpoint at
    DP=2 x TP=1 (`dp2xtp1`), the one-device checkpoint at TP=2 (`two`), and the killed runs' folders (`after_save`:
    --resume last, `after_aside`: --resume <folder>/last.ckpt, which the kill left only as last.ckpt.old)."""
    tmp = tmp_path_factory.mktemp("resumed")
    save_dir, aside_dir = killed["save"][1], killed["aside"][1]
    return fits(tmp, 2, {
        "exact": exact_resume_args(straight, tmp),
        "dp2xtp1": ("--steps", "6", "--resume", str(straight[2]), "--dp", "2", "--batch-size", "2"),
        "two": ("--tp", "2", "--steps", "6", "--resume", one_device["one"][1]),
        "after_save": (*KILL_ARGS, "--ckpt-dir", str(save_dir), "--resume", "last"),
        "after_aside": (*ASIDE_ARGS, "--ckpt-dir", str(aside_dir), "--resume", str(aside_dir / "last.ckpt")),
    })


@pytest.mark.slow
def test_exact_resume_with_last(straight, resumed):
    check_exact(straight[1], resumed["exact"][0])


@pytest.mark.parametrize("layout", ["tp1", "dp2xtp1"])
@pytest.mark.slow
def test_resume_at_another_layout(straight, one_device, resumed, layout):
    """A TP=2 checkpoint continues on one device and on DP=2 x TP=1 (FSDP2, --batch-size 2: the same global batch)."""
    check_resumed(straight[1], (one_device if layout == "tp1" else resumed)[layout][0])


@pytest.mark.slow
def test_tp1_checkpoint_resumes_at_tp2(straight, one_device, resumed):
    _, losses, _ = straight
    one, last = one_device["one"]
    assert one == pytest.approx({k: losses[k] for k in range(1, 5)}, rel=1e-5)
    assert resumed["two"][0] == pytest.approx({5: losses[5], 6: losses[6]}, rel=1e-5)


@pytest.mark.slow
def test_checkpoint_of_another_model_size_is_refused(straight, tmp_path):
    _, _, saved = straight
    cmd = [sys.executable, str(WORKERS / "ckpt_fit.py"), "--n-embd", "128", "--steps", "6", "--resume", str(saved),
           "--ckpt-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0
    assert "does not fit this model" in proc.stderr
    assert "model.transformer.wte.weight: checkpoint (50304, 64) vs model (50304, 128)" in proc.stderr
    assert sorted(os.listdir(saved)) == [".metadata", "__0_0.distcp", "__1_0.distcp", SUMS, "meta.pt"]  # untouched


@pytest.mark.slow
def test_kill_mid_save_then_resume_is_exact_with_dropout_and_accumulation(straight, killed, resumed):
    """TP=2 with dropout 0.1 and accumulate_grad_batches=2, SIGKILL inside the step-4 save: step 2 stays intact and
    is what 'last' resumes. The resumed run is bit-identical to an uninterrupted one (a wrong RNG restore changes
    the dropout masks, a wrong data position under accumulation the batches), and 'last.ckpt' follows it to step 6,
    with no 'last-v1.ckpt' beside it (every checkpoint is kept, so a stale 'last.ckpt' would still point at step 2)."""
    # the uninterrupted run, launched with the `straight` fixture's
    ref = {int(k): v for k, v in read_json(straight[0] / "dropout_accum.json")["losses"].items()}
    assert sorted(ref) == list(range(1, 7))
    proc, ckpt_dir, as_killed = killed["save"]
    assert "SIGKILL" in proc.stderr + proc.stdout
    assert sorted(os.listdir(as_killed)) == ["last.ckpt", "step0002.ckpt", "step0004.ckpt.partial"]
    assert os.readlink(as_killed / "last.ckpt") == "step0002.ckpt"
    check_checkpoint(as_killed / "step0002.ckpt")
    with pytest.raises(CheckpointError, match="unfinished checkpoint"):
        check_checkpoint(as_killed / "step0004.ckpt.partial")
    assert resumed["after_save"][0] == {k: ref[k] for k in range(3, 7)}  # --resume last in ckpt_dir
    assert sorted(os.listdir(ckpt_dir)) == ["last.ckpt", "step0002.ckpt", "step0004.ckpt", "step0006.ckpt"]
    assert os.readlink(ckpt_dir / "last.ckpt") == "step0006.ckpt"


@pytest.mark.slow
def test_kill_between_the_renames_of_an_overwrite_keeps_the_name(straight, killed, resumed):
    """save_last in copy mode and no version counter (a rerun saves over its own step names). SIGKILL right after
    the step-2 'last.ckpt' is moved aside to be overwritten at step 4, the one moment the name holds nothing: the
    next start puts 'last.ckpt.old' back, resumes from it exactly, and overwrites 'step0004.ckpt' and 'last.ckpt'."""
    _, losses, _ = straight
    proc, ckpt_dir, as_killed = killed["aside"]
    assert "SIGKILL" in proc.stderr + proc.stdout
    assert sorted(os.listdir(as_killed)) == ["last.ckpt.old", "last.ckpt.partial", "step0002.ckpt", "step0004.ckpt"]
    with pytest.raises(CheckpointError, match="save that replaced it was interrupted.*last.ckpt.old holds it"):
        check_checkpoint(as_killed / "last.ckpt")
    assert resumed["after_aside"][0] == {k: losses[k] for k in range(3, 7)}  # --resume ckpt_dir/last.ckpt
    assert sorted(os.listdir(ckpt_dir)) == ["last.ckpt", "step0004.ckpt", "step0006.ckpt"]
    check_checkpoint(ckpt_dir / "step0004.ckpt")
    assert torch.load(ckpt_dir / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 6


@pytest.mark.slow
def test_failed_fsync_stops_every_rank_at_once(tmp_path):
    """Rank 0's fsync fails while publishing the first checkpoint: both ranks exit with code 2 and the one error
    line within seconds (not the process-group timeout), nothing is published under the checkpoint's name, and the
    partial folder is removed."""
    stamp, ckpt_dir = tmp_path / "failed_at", tmp_path / "ckpt"
    proc = run_to_failure("--tp", "2", "--steps", "6", "--fail-fsync", str(stamp), "--ckpt-dir", str(ckpt_dir), "--out", str(tmp_path / "o"))
    assert time.time() - float(stamp.read_text()) < 30
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: publishing checkpoint {ckpt_dir}/step0002.ckpt failed on rank 0: OSError: [Errno 5] Input/output error "
        f"(injected): '{ckpt_dir}/step0002.ckpt.partial/meta.pt'; fix the storage (space, permissions) and resume from the last checkpoint"
    ]
    assert proc.stderr.count("exitcode  : 2 ") == 2  # torchrun's summary: both ranks ended with the error's code
    assert sorted(os.listdir(ckpt_dir)) == []  # the partial folder removed at once


@pytest.mark.slow  # about 2 s in this process (a Trainer built): the fast tier keeps its time
def test_cli_puts_a_moved_aside_checkpoint_back_first(tmp_path, user_run):
    """`cli.py fit --ckpt_path X` (its entry, in this process) when a kill left only `X.old`: the CLI's checks put X
    back before testing that it exists, so the run goes on to load it (here a stand-in folder, refused for its
    content, not as missing)."""
    aside = tmp_path / "step0004.ckpt.old"
    aside.mkdir()
    (aside / "meta.pt").write_bytes(b"x")
    line = user_run(lambda: cli.main(["fit", "--config", "configs/cpu.yaml", "--trainer.devices", "1", "--trainer.logger",
                                      "false", "--trainer.strategy.init_args.tensor_parallel_size", "1",
                                      "--ckpt_path", str(tmp_path / "step0004.ckpt")]))
    assert line == f"error: {tmp_path}/step0004.ckpt is not a complete distributed checkpoint: .metadata missing"
    assert sorted(os.listdir(tmp_path)) == ["step0004.ckpt"]


def test_recover_interrupted_saves(tmp_path):
    """A name moved aside whose replacement never arrived comes back; leftovers go only with clean."""
    for d in ("a.ckpt.old", "b.ckpt", "b.ckpt.old", "c.ckpt.partial"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "meta.pt").write_text(d)
    assert recover_interrupted_saves(tmp_path) == [tmp_path / "a.ckpt"]
    assert (tmp_path / "a.ckpt" / "meta.pt").read_text() == "a.ckpt.old"
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "b.ckpt.old", "c.ckpt.partial"]
    assert recover_interrupted_saves(tmp_path, clean=True) == []
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt"]
    assert (tmp_path / "b.ckpt" / "meta.pt").read_text() == "b.ckpt"


def test_bad_checkpoint_folders(ckpt, tmp_path):
    """conftest's one-process checkpoint (a shard file __0_0.distcp) with a part missing or corrupt."""
    saved, _ = ckpt
    with pytest.raises(CheckpointError, match="does not exist"):
        check_checkpoint(tmp_path / "nope")
    (tmp_path / "file.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file, not a distributed checkpoint"):
        check_checkpoint(tmp_path / "file.ckpt")
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    (broken / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard files __0_0.distcp"):
        check_checkpoint(broken)
    (broken / "meta.pt").unlink()
    with pytest.raises(CheckpointError, match="meta.pt missing"):
        check_checkpoint(broken)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(saved, corrupt)
    (corrupt / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="unreadable.*corrupt"):
        check_checkpoint(corrupt)


def _published(folder, value: float, mtime: float):
    """A one-process distributed checkpoint of 256 KiB, published as ModelParallel publishes one (with its CRC-32s)."""
    tmp = folder.with_name(folder.name + PARTIAL)
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp_save({"state_dict.w": torch.full((65536,), value)}, checkpoint_id=tmp)
    torch.save({"global_step": int(value)}, tmp / "meta.pt")
    publish(tmp, folder, [checksums(tmp, slice(0, None, 2)), checksums(tmp, slice(1, None, 2))])  # two ranks' shares
    os.utime(folder / "meta.pt", (mtime, mtime))
    return folder


def test_damaged_checkpoint_names_the_newest_intact_one(tmp_path):
    """A shard cut short is found by its size (every check), one overwritten at the same size by the CRC-32s recorded
    at save (check_intact; a rank's share of the files, or all); either names the newest intact checkpoint beside it,
    skipping a damaged one. A folder saved without checksums is checked by size only."""
    old, mid, new = (_published(tmp_path / f"step{i}.ckpt", i, 1000 + i) for i in (1, 2, 3))
    os.symlink("step3.ckpt", tmp_path / "last.ckpt")
    assert sorted(os.listdir(new)) == [".metadata", "__0_0.distcp", SUMS, "meta.pt"]
    for ckpt in (old, mid, new):
        check_intact(ckpt)
    shard = mid / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100_000:120_000] = os.urandom(20_000)  # 20 kB overwritten, same size
    shard.write_bytes(bytes(data))
    check_checkpoint(mid)  # sizes only
    check_intact(mid, slice(0, None, 2))  # .metadata and meta.pt: intact
    with pytest.raises(CheckpointError) as e:
        check_intact(mid, slice(1, None, 2))  # the shard
    assert str(e.value) == (f"checkpoint {mid} is damaged: {shard} does not match the CRC-32 its save recorded; the "
                            f"newest intact checkpoint beside it is {new}")
    size = (new / "__0_0.distcp").stat().st_size
    with open(new / "__0_0.distcp", "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(tmp_path / "last.ckpt")
    assert str(e.value) == (f"checkpoint {tmp_path / 'last.ckpt'} is damaged: {tmp_path / 'last.ckpt' / '__0_0.distcp'} "
                            f"is cut short ({size // 2} bytes; its .metadata needs {size}); the newest intact "
                            f"checkpoint beside it is {old}")
    (mid / SUMS).unlink()  # saved without checksums: sizes only
    check_intact(mid)


@pytest.mark.slow
def test_export_torch_and_hf(straight, tmp_path):
    """Consolidate the TP=2 checkpoint in one process; Hugging Face loads the export and gives our logits; a
    TP=2 run started from that HF folder (model.init_from) gives Hugging Face's loss."""
    transformers = pytest.importorskip("transformers")
    from gpt_tp.model import GPT, GPTConfig

    _, _, saved = straight
    out = tmp_path / "export"
    assert export_main([str(saved), "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.pt", "model.safetensors"]
    with pytest.raises(UserError, match="exists and is not an empty folder"):  # never overwrites
        export_main([str(saved), "--out", str(out)])
    with pytest.raises(CheckpointError, match="does not exist"):
        export_main([str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()

    d = torch.load(out / "model.pt")
    config, state = load_consolidated(saved)
    assert config.n_embd == 64
    assert d["config"]["n_embd"] == 64 and all(torch.equal(d["state_dict"][k], v) for k, v in state.items())
    ours = GPT(GPTConfig(**d["config"])).eval()
    ours.load_state_dict(d["state_dict"])
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 50257
    x = torch.randint(0, 50257, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :50257], hf(x).logits, rtol=1e-4, atol=1e-4)

    run_torchrun("hf_init.py", 2, "--hf-dir", str(out), "--out", str(tmp_path / "hf.json"))
    r = read_json(tmp_path / "hf.json")
    assert r["n_layer"] == 2 and r["ours"] == pytest.approx(r["hf"], rel=1e-5)
