"""Whole user paths through the commands: Hugging Face GPT-2 in, TP=2 fine-tuning with a resume on a longer
schedule (its checkpoint needing no init_from again), export, Hugging Face and HellaSwag out; and the metrics a
killed run leaves on disk."""

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import cli  # imported here, not under capsys: Lightning's log handlers keep the stream they first see
from conftest import ROOT, WORKERS

from gpt_tp.checkpoint.export import ExportError
from gpt_tp.checkpoint.export import main as export_main
from gpt_tp.model import GPT, GPTConfig
from gpt_tp.train.optim import get_lr


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)  # cli.py shares the cores between its processes
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[:3]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


# Lightning's and torch's lines that say nothing about a gpt_tp run (gpt_tp.train.logs.quiet_lightning and friends)
NOISE = ("litlogger", "litmodels", "LeafSpec", "Total FLOPs", "exists and is not empty", "`Trainer.fit` stopped", "torch.distributed is disabled",
         "Trainer already configured")


def rows(path) -> dict[int, dict[str, float]]:
    """metrics.csv's training rows by step."""
    with open(path) as f:
        return {int(r["step"]): {k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("train/loss")}


@pytest.mark.slow
def test_hugging_face_fine_tune_resume_export_hellaswag(tmp_path):
    """A GPT-2 folder as transformers writes it (vocabulary 50257; 3 layers, where configs/cpu.yaml says 2) ->
    model.init_from -> `cli.py fit --config configs/cpu.yaml` at TP=2 for 4 steps with warmup_steps 4 (a schedule
    no longer than its warmup) -> resumed from 'last' with max_steps 8 -> export -> transformers gives our logits ->
    HellaSwag scores the checkpoint and the exported folder alike. init_from with model.model fields of another shape
    builds the folder's model, says which fields went unused and records the model built; the fine-tune's checkpoint
    resumes, validates, predicts and exports without init_from, and so does the resumed run's: resumed again to 10
    steps, validated."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    shape = dict(n_layer=3, n_head=4, n_embd=64, n_positions=128)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50257, **shape)).save_pretrained(hf_dir)
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    (tmp_path / "run.yaml").write_text(json.dumps({  # JSON is YAML: the logger and checkpoints in tmp_path
        "trainer": {
            "log_every_n_steps": 1,
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(logs), "name": "ft"}}],
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
                "dirpath": str(ckpt), "filename": "step{step:04d}", "auto_insert_metric_name": False,
                "every_n_train_steps": 4, "save_top_k": -1, "save_last": "link"}}],
        },
        "model": {"warmup_steps": 4, "total_batch_size": 256},
        "data": {"batch_size": 2},  # 256-token steps: what this test shows is the path, not the batch
    }))
    fit = ("cli.py", "fit", "--config", "configs/cpu.yaml", "--config", str(tmp_path / "run.yaml"))
    first_run = run(*fit, "--trainer.max_steps", "4", "--model.init_from", str(hf_dir))
    assert (f"model.init_from={hf_dir} builds its config.json's model (n_layer=3, n_head=4, n_embd=64, "
            "block_size=128); model.model's n_layer=2 are not used") in first_run.stdout + first_run.stderr
    saved = torch.load(ckpt / "step0004.ckpt" / "meta.pt", weights_only=True)["hyper_parameters"]
    assert saved["model"]["n_layer"] == 3 and saved["init_from"] == str(hf_dir)
    # the fine-tune's checkpoint without init_from: resumed ('last', the checkpoint's model), and beside that run
    # validated and continued on one process (each command writes only its own output)
    one = ("--config", "configs/cpu.yaml", "--config", str(tmp_path / "run.yaml"), "--trainer.logger", "false",
           "--trainer.devices", "1", "--trainer.strategy.init_args.tensor_parallel_size", "1",
           "--ckpt_path", str(ckpt / "step0004.ckpt"))
    with ThreadPoolExecutor(3) as pool:
        second_run, _, _ = pool.map(lambda args: run(*args), [
            (*fit, "--trainer.max_steps", "8", "--ckpt_path", "last"),
            ("cli.py", "validate", *one), ("cli.py", "predict", *one, "--prompt", "ROMEO:", "--max_new_tokens", "4")])
    assert sorted(os.listdir(ckpt)) == ["last.ckpt", "step0004.ckpt", "step0008.ckpt"]
    # the resumed run's checkpoint (it recorded init_from null, and the model built): resumed again, and validated
    one8 = (*one[:-1], str(ckpt / "step0008.ckpt"))
    with ThreadPoolExecutor(2) as pool:
        third_run, validated = pool.map(lambda args: run(*args), [
            (*fit, "--trainer.max_steps", "10", "--ckpt_path", "last"), ("cli.py", "validate", *one8)])
    assert "val/loss" in validated.stdout

    # every step logged, on the schedule its run asked for: step 4, the first after the resume, starts the new
    # cosine at max_lr (the saved optimizer held the old schedule's end, min_lr)
    first, resumed = rows(logs / "ft" / "version_0" / "metrics.csv"), rows(logs / "ft" / "version_1" / "metrics.csv")
    assert sorted(first) == [0, 1, 2, 3] and sorted(resumed) == [4, 5, 6, 7]
    for steps, log in ((4, first), (8, resumed)):
        for s, r in log.items():
            assert r["train/lr"] == pytest.approx(get_lr(s, 3e-3, 3e-4, warmup_steps=4, max_steps=steps), rel=1e-6), s
    assert resumed[4]["train/lr"] == pytest.approx(3e-3) and get_lr(4, 3e-3, 3e-4, 4, 4) == 3e-4
    losses = [r["train/loss"] for r in (first | resumed).values()]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]

    out = tmp_path / "export"
    exported = run("-m", "gpt_tp.checkpoint.export", str(ckpt / "last.ckpt"), "--out", str(out))
    # what the user sees: none of Lightning's or torch's lines that say nothing about this run, and each command's
    # last line names what it wrote
    for proc in (first_run, second_run, third_run, exported):
        assert not any(noise in proc.stdout + proc.stderr for noise in NOISE), proc.stderr[-3000:]
    assert first_run.stdout.strip().splitlines()[-1] == (
        f"gpt_tp fit: step 4; checkpoints in {ckpt} (last.ckpt -> step0004.ckpt); logs in {logs / 'ft' / 'version_0'}")
    assert second_run.stdout.strip().splitlines()[-1].startswith(
        f"gpt_tp fit: step 8; checkpoints in {ckpt} (last.ckpt -> step0008.ckpt)")
    assert third_run.stdout.strip().splitlines()[-1].startswith(
        f"gpt_tp fit: step 10; checkpoints in {ckpt} (last.ckpt -> step0010.ckpt)")
    assert exported.stdout.strip().splitlines()[-1] == f"wrote {out}"
    d = torch.load(out / "model.pt")
    ours = GPT(GPTConfig(**d["config"])).eval()
    ours.load_state_dict(d["state_dict"])
    assert (ours.config.n_layer, ours.config.vocab_used) == (3, 50257)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    start = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    x = torch.randint(0, 50257, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :50257], hf(x).logits, rtol=1e-4, atol=1e-4)
        assert (hf(x).logits - start(x).logits).abs().max() > 1e-2  # 10 steps of fine-tuning changed the model

    # HellaSwag on the fixture by `cli.py validate`: the checkpoint and its exported folder score alike
    validate = ("cli.py", "validate", *one[:-2], "--trainer.callbacks", "gpt_tp.eval.hellaswag.HellaSwagCallback",
                "--trainer.callbacks.path", "tests/fixtures/hellaswag_small.jsonl")
    with ThreadPoolExecutor(2) as pool:
        scored = pool.map(lambda args: run(*args), [(*validate, "--ckpt_path", str(ckpt / "last.ckpt")),
                                                    (*validate, "--model.init_from", str(out))])
    a, b = (re.search(r"HellaSwag acc_norm (\d+/\d+ = \S+), acc (\S+)", p.stdout).groups() for p in scored)
    assert a == b and "/11 = " in a[0]


@pytest.mark.slow
def test_killed_run_keeps_the_rows_it_logged(tmp_path):
    """SIGKILL inside step 5 (no Python cleanup runs): metrics.csv holds steps 0-4. The Trainer has the CSVLogger
    write each row as it is logged (its own flush_logs_every_n_steps=100 alone would keep them in memory)."""
    proc = subprocess.run([sys.executable, str(WORKERS / "killed_fit.py"), "--logs", str(tmp_path), "--kill-at", "5"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    logged = rows(tmp_path / "run" / "version_0" / "metrics.csv")
    assert sorted(logged) == [0, 1, 2, 3, 4]
    assert all(math.isfinite(r["train/loss"]) and r["train/loss"] > 5 for r in logged.values())


def test_export_mistakes_are_one_line(tmp_path, command_here):
    """export's entry (what `python -m gpt_tp.checkpoint.export` runs; that process itself:
    test_hugging_face_fine_tune_resume_export_hellaswag) on a missing checkpoint: one line, exit code 2; a non-empty
    --out is refused, untouched."""
    ckpt = tmp_path / "nothing.ckpt"
    proc = command_here(lambda: export_main([str(ckpt), "--out", str(tmp_path / "x")]))
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: checkpoint folder {ckpt} does not exist"), proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == "", proc.stderr  # no traceback
    assert not (tmp_path / "x").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"--out .*out exists and is not an empty folder; choose a new --out"):
        export_main([str(ckpt), "--out", str(tmp_path / "out")])
    assert os.listdir(tmp_path / "out") == ["keep.txt"] and (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_checkpoint_records_the_model_and_optimizer_every_command_uses(tmp_path, user_run):
    """A run trained with --model.model.n_embd 48 and --model.optimizer Muon (one process) is resumed, validated and
    predicted from without those flags: each command uses the checkpoint's model and optimizer (a --config file's
    values are not the user's flags). A flag that agrees is accepted; one that disagrees is refused in one line
    naming both values, before anything runs (in this process; the real `cli.py validate`'s refusal:
    tests/test_bad_inputs.py::test_checkpoint_of_another_size_through_cli_leaves_it_unchanged)."""
    ckpt = tmp_path / "ckpt"
    base = ("--config", "configs/cpu.yaml", "--trainer.logger", "false", "--trainer.devices", "1",
            "--trainer.strategy.init_args.tensor_parallel_size", "1", "--data.val_batches", "1",
            "--trainer.callbacks", "gpt_tp.checkpoint.AtomicModelCheckpoint", "--trainer.callbacks.dirpath", str(ckpt),
            "--trainer.callbacks.save_last", "link")
    run("cli.py", "fit", *base, "--trainer.max_steps", "2", "--model.model.n_embd", "48", "--model.optimizer", "Muon")
    last = ("--ckpt_path", "last")
    with ThreadPoolExecutor(3) as pool:
        resumed, validated, predicted = pool.map(lambda args: run(*args), [
            ("cli.py", "fit", *base, "--trainer.max_steps", "3", *last),
            ("cli.py", "validate", *base, "--ckpt_path", str(ckpt / "epoch=1-step=2.ckpt"), "--model.model.n_embd", "48"),
            ("cli.py", "predict", *base, "--ckpt_path", str(ckpt / "epoch=1-step=2.ckpt"), "--prompt", "ROMEO:",
             "--max_new_tokens", "2")])
    assert resumed.stdout.strip().splitlines()[-1].startswith("gpt_tp fit: step 3; ")
    assert "val/loss" in validated.stdout and "gpt_tp predict: 1 continuation printed" in predicted.stdout
    saved = torch.load(ckpt / "last.ckpt" / "meta.pt", weights_only=True)
    assert saved["global_step"] == 3 and saved["hyper_parameters"]["model"]["n_embd"] == 48
    assert saved["hyper_parameters"]["optimizer"]["class_path"] == "gpt_tp.train.optim.Muon"
    for flag, line in ((("--model.model.n_embd", "64"), "--model.model.n_embd=64, but {} was trained with "
                        "model.model.n_embd=48"), (("--model.optimizer", "AdamW"), "--model.optimizer=AdamW, but {} "
                        "was trained with model.optimizer=Muon")):
        assert user_run(lambda: cli.main(["validate", *base, *last, *flag])) == (
            f"error: {line.format(ckpt / 'last.ckpt')}: drop the flag (the checkpoint's value is used), or start a new run")


def val_loss(proc: subprocess.CompletedProcess) -> float:
    return float(re.search(r"val/loss\s*│\s*(\S+)", proc.stdout)[1])


@pytest.mark.slow
def test_one_file_checkpoint_of_a_single_device_run_loads_into_tensor_parallel(tmp_path):
    """`--trainer.strategy auto` on one device saves one file. It validates at TP=2 (configs/cpu.yaml) to the val loss
    it has on one device, and resumes at TP=2 (its optimizer state re-keyed onto the sharded parameters) to the
    weights a one-device resume reaches: the two resumed checkpoints validate alike at TP=2, within 1e-5."""
    def ckpt(name: str) -> tuple[str, ...]:
        return ("--trainer.callbacks", "gpt_tp.checkpoint.AtomicModelCheckpoint", "--trainer.callbacks.dirpath",
                str(tmp_path / name), "--trainer.callbacks.save_last", "link")
    common = ("--config", "configs/cpu.yaml", "--trainer.logger", "false", "--data.val_batches", "2")
    auto = ("--trainer.devices", "1", "--trainer.strategy", "auto")
    run("cli.py", "fit", *common, *auto, *ckpt("one"), "--trainer.max_steps", "2")
    one = tmp_path / "one" / "last.ckpt"
    assert one.is_file()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda args: run(*args), [
            ("cli.py", "fit", *common, *ckpt("tp2"), "--trainer.max_steps", "3", "--ckpt_path", str(one)),
            ("cli.py", "fit", *common, *auto, *ckpt("one_more"), "--trainer.max_steps", "3", "--ckpt_path", str(one))]))
    assert (tmp_path / "tp2" / "last.ckpt" / "meta.pt").is_file() and (tmp_path / "one_more" / "last.ckpt").is_file()
    with ThreadPoolExecutor(2) as pool:
        at_tp2, on_one, tp2_resumed, one_resumed = map(val_loss, pool.map(lambda args: run(*args), [
            ("cli.py", "validate", *common, "--ckpt_path", str(one)),
            ("cli.py", "validate", *common, *auto, "--ckpt_path", str(one)),
            ("cli.py", "validate", *common, "--ckpt_path", str(tmp_path / "tp2" / "last.ckpt")),
            ("cli.py", "validate", *common, "--ckpt_path", str(tmp_path / "one_more" / "last.ckpt"))]))
    print(f"val/loss of the one-file checkpoint: {at_tp2} at TP=2, {on_one} on one device; resumed to step 3: "
          f"{tp2_resumed} (at TP=2), {one_resumed} (on one device)")
    assert at_tp2 == pytest.approx(on_one, abs=1e-5) and tp2_resumed == pytest.approx(one_resumed, abs=1e-5)
    assert abs(tp2_resumed - at_tp2) > 1e-4  # the resumed step changed the weights
