"""The command line as users run it: `python cli.py fit --config configs/cpu.yaml` (Lightning launches the
second process itself), its validation errors, and `--ckpt_path last`."""

import csv
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def cli(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_print_config():
    proc = cli("fit", "--config", "configs/cpu.yaml", "--print_config")
    assert proc.returncode == 0, proc.stderr
    assert "tensor_parallel_size: 2" in proc.stdout and "class_path: gpt_tp.checkpoint.ModelParallel" in proc.stdout
    proc = cli("fit", "--config", "configs/tp2.yaml", "--print_config")
    assert proc.returncode == 0, proc.stderr
    assert "total_batch_size: 524288" in proc.stdout and "accumulate_grad_batches: 32" in proc.stdout


def one_error_line(proc) -> str:
    """A user's mistake: exit code 2, no traceback anywhere in the output, exactly one `error:` line; returns it."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and 'File "' not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    return errors[0]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--trainer.strategy.init_args.tensor_parallel_size", "3"], "data_parallel_size=1 x tensor_parallel_size=3 = 3, but the run has 2 devices"),
        (["--trainer.devices", "3", "--trainer.strategy.init_args.tensor_parallel_size", "3"], "tensor_parallel_size=3 must divide model.n_head=4"),
        (["--model.total_batch_size", "4096"], "set trainer.accumulate_grad_batches=4"),
        (["--data.seq_len", "127", "--model.total_batch_size", "null"], "must divide the sequence length (data.seq_len)=127"),
        (["--data.seq_len", "256", "--model.total_batch_size", "null"], "data.seq_len=256 exceeds the model's block_size=128"),
        (["--data.data_dir", "no/such/dir"], "no/such/dir"),
        (["--model.model", "gpt5"], "unknown model size 'gpt5'"),
        (["--model.init_from", "no/such/hf"], "no/such/hf/config.json not found"),
        (["--ckpt_path", "no/such/ckpt"], "--ckpt_path no/such/ckpt: no such checkpoint"),
        (["--model.async_tp", "true", "--model.compile", "true"], "async TP needs CUDA GPUs"),
    ],
    ids=["world-size", "heads", "total-batch", "seq-len-split", "seq-len-block", "data-dir", "model-size", "init-from", "ckpt-path", "async-tp-on-cpu"],
)
def test_bad_flags_fail_before_training_with_one_line(tmp_path, flags, message):
    proc = cli("fit", "--config", "configs/cpu.yaml", "--trainer.logger", "false", *flags, timeout=300)
    assert message in one_error_line(proc)


def test_test_subcommand_is_not_offered():
    assert "use `python cli.py validate" in one_error_line(cli("test", "--config", "configs/cpu.yaml"))
    help_text = cli("--help").stdout
    assert "validate" in help_text and "predict" in help_text and "{fit,validate,predict}" in help_text


def test_auto_layout_is_planned(tmp_path):
    """Both sizes 'auto' on 2 CPU processes: no device memory to plan for, so the smallest valid TP (DP=2 x TP=1)."""
    proc = cli("fit", "--config", "configs/cpu.yaml", "--trainer.logger", "false", "--trainer.callbacks", "[]",
               "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--model.total_batch_size", "null",
               "--trainer.strategy.init_args.tensor_parallel_size", "auto", "--trainer.strategy.init_args.data_parallel_size", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gpt_tp planner: DP=2 x TP=1" in proc.stderr


def losses(log_dir):
    rows = list(csv.DictReader(open(log_dir / "metrics.csv")))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def test_cpu_demo_trains_and_resumes_exactly(tmp_path):
    override = tmp_path / "short.yaml"
    override.write_text(
        f"""
trainer:
  max_steps: 6
  val_check_interval: 3
  log_every_n_steps: 1
  logger:
  - class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {tmp_path / "logs"}, name: run}}
  callbacks:
  - class_path: lightning.pytorch.callbacks.ModelCheckpoint
    init_args: {{dirpath: {tmp_path / "ckpt"}, filename: "step{{step:07d}}", auto_insert_metric_name: false,
                every_n_train_steps: 3, save_top_k: 2, monitor: step, mode: max, save_last: link}}
data:
  val_batches: 2
"""
    )
    base = ("fit", "--config", "configs/cpu.yaml", "--config", str(override))
    straight = cli(*base, "--trainer.max_steps", "9", "--trainer.callbacks", "[]")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = cli(*base)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["last.ckpt", "step0000003.ckpt", "step0000006.ckpt"]
    resumed = cli(*base, "--trainer.max_steps", "9", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    runs = sorted((tmp_path / "logs" / "run").iterdir())
    full, part1, part2 = (losses(d) for d in runs)
    assert len(full) == 9 and full[8] < full[0] - 0.5  # the loss falls on the bundled sample (still in warmup)
    assert part1 == {k: full[k] for k in range(6)}
    assert part2 == {k: full[k] for k in range(6, 9)}  # bit-identical after --ckpt_path last
