"""The command line as users run it: `python cli.py fit --config configs/cpu.yaml` (Lightning launches the
second process itself), its validation errors, and `--ckpt_path last`."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

import cli as cli_module  # imported before any capsys: Lightning's log handlers keep the stream they first see
from conftest import ROOT, one_error_line


def cli(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def side_by_side(*commands, timeout=600) -> list[subprocess.CompletedProcess]:
    """cli() for each command at once (commands that neither write what another reads): process start-up leaves
    cores idle that the others use."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: cli(*args, timeout=timeout), commands))


@pytest.mark.slow
def test_print_config():
    proc, tp2 = side_by_side(("fit", "--config", "configs/cpu.yaml", "--print_config"),
                             ("fit", "--config", "configs/tp2.yaml", "--print_config"))
    assert proc.returncode == 0, proc.stderr
    assert "tensor_parallel_size: 2" in proc.stdout and "class_path: gpt_tp.checkpoint.ModelParallel" in proc.stdout
    proc = tp2
    assert proc.returncode == 0, proc.stderr
    assert "total_batch_size: 524288" in proc.stdout and "accumulate_grad_batches: 32" in proc.stdout


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--trainer.strategy.init_args.tensor_parallel_size", "3"], "trainer.strategy.init_args.data_parallel_size=1, trainer.strategy.init_args.tensor_parallel_size=3, "
         "trainer.devices=2 x trainer.num_nodes=1: data-parallel size 1 x tensor-parallel size 3 = 3, but the run has 2 devices"),
        (["--trainer.devices", "3", "--trainer.strategy.init_args.tensor_parallel_size", "3"], "trainer.strategy.init_args.tensor_parallel_size=3, model.model.n_head=4: "
         "tensor-parallel size 3 must divide n_head=4"),
        (["--model.total_batch_size", "4096"], "set trainer.accumulate_grad_batches=4"),
        (["--data.seq_len", "127", "--model.total_batch_size", "null"], "trainer.strategy.init_args.tensor_parallel_size=2, data.seq_len=127: "
         "tensor-parallel size 2 must divide seq_len=127"),
        (["--data.seq_len", "256", "--model.total_batch_size", "null"], "data.seq_len=256 exceeds the model's block_size=128"),
        (["--data.data_dir", "no/such/dir"], "no/such/dir"),
        (["--model.model", "gpt5"], "unknown model size 'gpt5'"),
        (["--model.init_from", "no/such/hf"], "no/such/hf: no such folder; model.init_from takes a Hugging Face GPT-2 folder"),
        (["--ckpt_path", "no/such/ckpt"], "--ckpt_path no/such/ckpt: no such checkpoint"),
        (["--model.async_tp", "true"], "unrecognized arguments: --model.async_tp true"),  # no async TP setting
        (["--trainer.precision", "16-mixed"], "trainer.precision=16-mixed: ModelParallelStrategy has no fp16 gradient scaler"),
        (["--model.n_layerx", "3"], "unrecognized arguments: --model.n_layerx 3 (see python cli.py fit --help)"),
    ],
    ids=["world-size", "heads", "total-batch", "seq-len-split", "seq-len-block", "data-dir", "model-size", "init-from", "ckpt-path",
         "no-async-tp", "fp16-under-tp", "unknown-flag"],
)
def test_bad_flags_fail_before_training_with_one_line(user_run, flags, message):
    """Refused in the launching process, before any rank starts: run in this process as cli.py's __main__ runs it."""
    assert message in user_run(lambda: cli_module.main(["fit", "--config", "configs/cpu.yaml", "--trainer.logger", "false", *flags]))


@pytest.mark.slow
def test_test_subcommand_is_not_offered():
    test, help_ = side_by_side(("test", "--config", "configs/cpu.yaml"), ("--help",))
    assert "use `python cli.py validate" in one_error_line(test)
    help_text = help_.stdout
    assert "validate" in help_text and "predict" in help_text and "{fit,validate,predict}" in help_text


def losses(log_dir):
    rows = list(csv.DictReader(open(log_dir / "metrics.csv")))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def demo_override(path, ckpt, logs, version: int) -> str:
    """A config file at path: 9 steps validating every 3 on 2 batches, every step logged to a CSVLogger (its version
    given: runs side by side would race for the next free one), checkpoints every 3 into ckpt."""
    path.write_text(f"""
trainer:
  max_steps: 9
  val_check_interval: 3
  log_every_n_steps: 1
  logger:
  - class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {logs}, name: run, version: {version}}}
  callbacks:
{demo_checkpoints(ckpt)}data:
  val_batches: 2
""")
    return str(path)


def demo_checkpoints(ckpt) -> str:
    return f"""  - class_path: lightning.pytorch.callbacks.ModelCheckpoint
    init_args: {{dirpath: {ckpt}, filename: "step{{step:07d}}", auto_insert_metric_name: false,
                every_n_train_steps: 3, save_top_k: 2, monitor: step, mode: max, save_last: link}}
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The CPU demo (configs/cpu.yaml, TP=2) for 9 steps through `cli.py fit`: straight through, its layout given as
    'auto' (test_auto_layout_is_planned), beside a run stopped after step 6 as a preemption would, started with
    --ckpt_path last before any checkpoint; then, side by side, that run resumed with --ckpt_path last, and a copy of
    its folder resumed at half the batch and twice the accumulation
    (test_resume_with_half_the_batch_and_twice_the_accumulation). The resumed run's last checkpoint is
    test_validate_and_predict_from_the_demo_checkpoint's. Runs side by side share no file; tests only read these."""
    tmp = tmp_path_factory.mktemp("demo")
    ckpt, logs = tmp / "ckpt", tmp / "logs"
    stop = tmp / "stop.yaml"
    stop.write_text(f"trainer:\n  callbacks:\n{demo_checkpoints(ckpt)}  - class_path: tests.workers.stop_at.StopAt\n"
                    "    init_args: {step: 6}\n")
    base = ("fit", "--config", "configs/cpu.yaml", "--config")
    straight, first = side_by_side(
        (*base, demo_override(tmp / "straight.yaml", ckpt, logs, 0), "--trainer.callbacks", "[]",
         "--trainer.strategy.init_args.tensor_parallel_size", "auto",
         "--trainer.strategy.init_args.data_parallel_size", "auto"),
        # a first Slurm run: `last` before any checkpoint
        (*base, demo_override(tmp / "first.yaml", ckpt, logs, 1), "--config", str(stop), "--ckpt_path", "last"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert first.returncode == 0, first.stderr[-3000:]
    stopped = sorted(os.listdir(ckpt))
    shutil.copytree(ckpt, tmp / "half" / "ckpt", symlinks=True)
    resumed, half = side_by_side(
        (*base, demo_override(tmp / "resumed.yaml", ckpt, logs, 2), "--ckpt_path", "last"),
        (*base, demo_override(tmp / "half.yaml", tmp / "half" / "ckpt", tmp / "half" / "logs", 0),
         "--data.batch_size", "4", "--trainer.accumulate_grad_batches", "2", "--trainer.val_check_interval", "2",
         "--ckpt_path", "last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return SimpleNamespace(tmp=tmp, straight=straight, first=first, stopped=stopped, resumed=resumed, half=half,
                           runs=sorted((logs / "run").iterdir()))


@pytest.mark.slow
def test_auto_layout_is_planned(demo):
    """Both sizes 'auto' on 2 CPU processes, no device memory to plan for: the smallest valid TP among the layouts
    the batch adds up for. cpu.yaml's total_batch_size (8 x 128 x DP x 1 = 1024) takes DP=1, so TP=2 (without a
    total the smallest TP, DP=2 x TP=1: tests/test_planner.py::test_auto_layout_takes_the_batch_that_adds_up).
    The demo fixture's uninterrupted run is that run; test_cpu_demo_trains_and_resumes_exactly finds its losses
    bit-identical to those of the runs given TP=2."""
    assert "gpt_tp planner: DP=1 x TP=2" in demo.straight.stderr
    assert demo.straight.stderr.count("gpt_tp planner:") == 1  # rank 0's, not once per rank


@pytest.mark.slow
def test_cpu_demo_trains_and_resumes_exactly(demo):
    """A 9-step run stopped after step 6 (as a preemption would) and resumed with --ckpt_path last logs the losses of
    the uninterrupted 9-step run, bit for bit; its first start, before any checkpoint, says so in one line."""
    tmp_path, straight, first, resumed = demo.tmp, demo.straight, demo.first, demo.resumed
    # cpu.yaml's 10 warmup steps outlast this 9-step run: said before launch
    assert ("model.warmup_steps=10 >= trainer.max_steps=9: the run ends inside its warmup, its last step at lr 0.0027 of "
            "model.max_lr=0.003, with no cosine decay") in straight.stderr
    assert first.stderr.count(f"gpt_tp: no checkpoint in {tmp_path / 'ckpt'}: starting from step 0") == 1  # not per rank
    assert "save_last" not in first.stderr  # not Lightning's advice to set what is already set
    assert demo.stopped == ["last.ckpt", "step0000003.ckpt", "step0000006.ckpt"]
    # resumed mid-epoch (step 6 was a periodic save): still gpt_tp's bar, in steps; no notice about the folder it
    # resumes from; one closing line naming what it wrote
    assert "train:" in resumed.stdout and "Training" not in resumed.stdout
    assert "exists and is not empty" not in resumed.stderr
    closing = resumed.stdout.strip().splitlines()[-1]
    assert closing.startswith(f"gpt_tp fit: step 9; checkpoints in {tmp_path / 'ckpt'} (last.ckpt -> ")
    assert closing.endswith(f"step0000009.ckpt); logs in {tmp_path / 'logs' / 'run' / 'version_2'}")
    runs = demo.runs
    full, part1, part2 = (losses(d) for d in runs)
    assert len(full) == 9 and full[8] < full[0] - 0.5  # the loss falls on the bundled sample (still in warmup)
    assert part1 == {k: full[k] for k in range(6)}
    assert part2 == {k: full[k] for k in range(6, 9)}  # bit-identical after --ckpt_path last
    # the plot's lineage: the resumed run continues the stopped one by its TP=2 checkpoint, not the uninterrupted one
    from gpt_tp.train.plot import run_csvs

    csvs = [d / "metrics.csv" for d in runs]
    assert run_csvs(csvs[2]) == csvs[1:] and run_csvs(csvs[0]) == csvs[:1]


@pytest.mark.slow
def test_resume_with_half_the_batch_and_twice_the_accumulation(demo):
    """The demo stopped after step 6 at B=8 (a copy of its folder) and resumed at B=4 x 2 accumulation (the same 1024
    tokens a step): the losses of the uninterrupted run (within float reordering), no 'not an exact continuation'
    warning, and a warning that the micro-batch val_check_interval now validates at other steps."""
    resumed = demo.half
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not an exact continuation" not in resumed.stderr
    assert ("trainer.val_check_interval=2 counts micro-batches: with trainer.accumulate_grad_batches=2 (was 1) "
            "validation comes every 1 optimizer steps, not every 2; set trainer.val_check_interval=4 to keep the "
            "steps it validates at") in resumed.stderr
    full, part2 = losses(demo.runs[0]), losses(demo.tmp / "half" / "logs" / "run" / "version_0")
    assert sorted(part2) == [6, 7, 8], part2
    assert all(part2[k] == pytest.approx(full[k], rel=1e-5) for k in part2), (part2, full)


@pytest.mark.slow
def test_validate_and_predict_from_the_demo_checkpoint(demo, tmp_path):
    """validate reports val loss and HellaSwag from a TP=2 checkpoint (the demo fixture's, step 9) at TP=2 and on one
    process, with the same val loss; predict continues prompts at TP=2 with the same text as one process."""
    ckpt = demo.tmp / "ckpt"
    hellaswag = ("--trainer.callbacks", "gpt_tp.eval.hellaswag.HellaSwagCallback", "--trainer.callbacks.path", "tests/fixtures/hellaswag_small.jsonl")
    validates = [("validate", "--config", "configs/cpu.yaml", "--trainer.logger", "false", *hellaswag, *layout,
                  "--ckpt_path", str(ckpt / "last.ckpt"))
                 for layout in (("--trainer.strategy.init_args.tensor_parallel_size", "2"),
                                ("--trainer.strategy.init_args.tensor_parallel_size", "1", "--trainer.devices", "1"))]
    out_files = [tmp_path / f"pred{tp}.jsonl" for tp in ("2", "1")]
    predicts = [("predict", "--config", "configs/cpu.yaml", "--trainer.logger", "false", "--trainer.callbacks", "[]",
                 "--trainer.devices", tp, "--trainer.strategy.init_args.tensor_parallel_size", tp,
                 "--ckpt_path", str(ckpt / "last.ckpt"), "--prompt", '["To be, or not to be", "ROMEO:"]',
                 "--num_samples", "2", "--max_new_tokens", "12", "--output", str(out_file))
                for tp, out_file in zip(("2", "1"), out_files)]
    procs = side_by_side(*validates, *predicts)  # each reads the checkpoint and writes only its own output
    val_losses = []
    for proc in procs[:2]:
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout + proc.stderr
        val_losses.append(float(re.search(r"val/loss\s*[│|]?\s*([0-9.]+)", out).group(1)))
        assert re.search(r"step 9: HellaSwag acc_norm \d+/11", out), out[-2000:]  # the checkpoint's step
        assert proc.stdout.strip().splitlines()[-1] == f"gpt_tp validate: {ckpt / 'last.ckpt'}; no logger"
        assert "RNG states" not in proc.stderr
    assert val_losses[0] == pytest.approx(val_losses[1], rel=1e-5) and 5 < val_losses[0] < 11
    texts = []
    for proc, out_file in zip(procs[2:], out_files):
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in out_file.read_text().splitlines()]
        assert [(r["prompt"], r["sample"]) for r in rows] == [("To be, or not to be", 0), ("To be, or not to be", 1), ("ROMEO:", 0), ("ROMEO:", 1)]
        assert all(r["text"].startswith(r["prompt"]) and len(r["text"]) > len(r["prompt"]) for r in rows)
        assert proc.stdout.count("prompt 'ROMEO:' sample 1:") == 1  # printed once, by rank 0
        assert proc.stdout.strip().splitlines()[-1] == f"gpt_tp predict: 4 continuations written to {out_file}"
        assert "batch indices" not in proc.stderr and "RNG states" not in proc.stderr
        texts.append([r["text"] for r in rows])
    assert texts[0] == texts[1]


@pytest.mark.slow
def test_progress_bar_counts_optimizer_steps():
    """accumulate_grad_batches=4, max_steps=3: the bar goes to 3/3 (not 12/3), shows loss, tok/s and lr, no epoch.
    val_check_interval beyond the run's 12 micro-batches: a warning says no validation will run."""
    proc = cli("fit", "--config", "configs/cpu.yaml", "--trainer.logger", "false", "--trainer.callbacks", "[]",
               "--trainer.devices", "1", "--trainer.strategy", "auto", "--trainer.accumulate_grad_batches", "4",
               "--trainer.max_steps", "3", "--model.total_batch_size", "null", "--data.val_batches", "1",
               "--trainer.val_check_interval", "40", "--data.batch_size", "2", "--data.seq_len", "32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    frames = re.split(r"[\r\n]", proc.stdout + proc.stderr)
    counts = [m.group(1) for f in frames if (m := re.search(r"train: .*?\| (\d+/\d+) ", f))]
    assert counts and counts[-1] == "3/3" and set(counts) <= {"0/3", "1/3", "2/3", "3/3"}, counts
    last = [f for f in frames if "3/3" in f][-1]
    assert "loss=" in last and "tok/s=" in last and "lr=" in last
    assert "Epoch" not in proc.stdout + proc.stderr
    assert "trainer.val_check_interval=40 micro-batches is beyond the run's 3 steps x 4 accumulation: no validation" in proc.stderr
    assert "val/loss" not in proc.stdout + proc.stderr


@pytest.mark.slow  # about 2 s in this process (a Trainer built): the fast tier keeps its time
def test_unwritable_log_folder_is_one_line_before_launch(tmp_path, user_run):
    (tmp_path / "logs").write_text("a file where the log folder should be")
    line = user_run(lambda: cli_module.main(["fit", "--config", "configs/cpu.yaml", "--trainer.logger",
                                             "lightning.pytorch.loggers.CSVLogger",
                                             "--trainer.logger.save_dir", str(tmp_path / "logs" / "run")]))
    assert f"trainer.logger: cannot create the log folder {tmp_path / 'logs' / 'run'}" in line
    assert (tmp_path / "logs").read_text() == "a file where the log folder should be"


def test_progress_bar_is_ours_with_or_without_rich(monkeypatch):
    import lightning.pytorch.trainer.connectors.callback_connector as connector

    from gpt_tp.cli.main import GPTCLI
    from gpt_tp.train.progress import StepProgressBar

    args = ["--config", "configs/cpu.yaml", "--trainer.logger", "false", "--trainer.devices", "1", "--trainer.strategy", "auto"]
    for rich in (True, False):
        monkeypatch.setattr(connector, "_RICH_AVAILABLE", rich)
        monkeypatch.chdir(ROOT)
        cli_ = GPTCLI(args=args, run=False)
        assert type(cli_.trainer.progress_bar_callback) is StepProgressBar
    off = GPTCLI(args=[*args, "--trainer.enable_progress_bar", "false"], run=False)
    assert off.trainer.progress_bar_callback is None
