"""read_training_config: the settings `python cli.py fit` trains with, read by the same parser (every --config in
order, then the command-line overrides, over the classes' defaults)."""

import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from gpt_tp.errors import UserError
from gpt_tp.model import GPTConfig
from gpt_tp.cli.config import model_parallel, read_training_config
from gpt_tp.cli.planner import training_settings


@pytest.mark.slow
def test_two_configs_and_an_override_read_as_cli_fit_prints_them(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    extra = tmp_path / "extra.yaml"
    extra.write_text("model:\n  model: {n_layer: 3, n_head: 8, n_embd: 128, block_size: 256}\n  activation_checkpointing: full\n"
                     "data:\n  batch_size: 4\ntrainer:\n  devices: 4\n  precision: bf16-mixed\n")
    args = ["--config", "configs/cpu.yaml", "--config", str(extra), "--data.seq_len", "64",
            "--trainer.strategy.init_args.data_parallel_size", "auto", "--trainer.accumulate_grad_batches", "3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "cli.py", "fit", *args, "--print_config"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = yaml.safe_load(proc.stdout)
    c = read_training_config(args)

    model = printed["model"]["model"]
    assert c.model == GPTConfig(**model) == GPTConfig(n_layer=3, n_head=8, n_embd=128, block_size=256)
    assert model["vocab_size"] == 50304  # cpu.yaml's field, kept under extra.yaml's
    trainer, data = printed["trainer"], printed["data"]
    d, t = c.fit.data, c.fit.trainer
    assert (d.batch_size, d.seq_len, d.data_dir, d.val_batches) == (
        data["batch_size"], data["seq_len"], data["data_dir"], data["val_batches"]) == (4, 64, "data/sample", 4)
    assert (c.devices, t.num_nodes, t.precision, t.accumulate_grad_batches, t.max_steps) == (
        trainer["devices"], trainer["num_nodes"], trainer["precision"], trainer["accumulate_grad_batches"],
        trainer["max_steps"]) == (4, 1, "bf16-mixed", 3, 120)
    init = trainer["strategy"]["init_args"]
    assert (init["data_parallel_size"], init["tensor_parallel_size"]) == ("auto", 2)
    assert (c.dp, c.tp, model_parallel(t.strategy)) == (2, 2, True)  # DP: the 4 devices over TP
    m = c.fit.model
    assert m.activation_checkpointing == printed["model"]["activation_checkpointing"] == "full"
    assert (m.total_batch_size, m.compile) == (printed["model"]["total_batch_size"], printed["model"]["compile"]) == (1024, False)


def test_class_defaults_apply():
    c = read_training_config([])
    assert c.model == GPTConfig.from_name("gpt2")
    d, t = c.fit.data, c.fit.trainer
    assert (d.batch_size, d.seq_len, d.data_dir, d.val_batches) == (16, 1024, "data/sample", 20)  # GPTDataModule's
    assert (t.precision, t.accumulate_grad_batches, t.num_nodes, c.fit.model.activation_checkpointing) == (
        None, 1, 1, "none")
    assert training_settings([])["precision"] == "32-true"  # Lightning's default (None), as the planner plans it
    assert (t.strategy, c.tp, c.dp, c.devices) == ("auto", 1, "auto", None)
    c = read_training_config(["--trainer.strategy", "ddp", "--trainer.devices", "3", "--trainer.num_nodes", "2"])
    assert (c.tp, c.dp) == (1, 6)  # DP: the world, 3 devices x 2 nodes


def test_init_from_reads_the_folders_config(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2", "n_positions": 64, "n_layer": 3, "n_head": 2, "n_embd": 32, '
                                    '"vocab_size": 50257}')
    c = read_training_config(["--model.init_from", str(hf)])
    assert c.model == GPTConfig(block_size=64, n_layer=3, n_head=2, n_embd=32, vocab_size=50304, vocab_used=50257)
    assert c.fit.model.init_from == str(hf)


@pytest.mark.parametrize("args,message", [
    (["--data.batch_size", "x"], 'Parser key "data.batch_size"'),
    (["--model.n_layerx", "3"], "unrecognized arguments: --model.n_layerx 3"),
    (["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
    (["--model.model", "gpt5"], "unknown model size 'gpt5'"),
    (["--model.init_from", "no/such/hf"], "model.init_from=no/such/hf: no/such/hf/config.json not found"),
    (["--config", "configs/cpu.yaml", "--trainer.precision", "16-mixed"], "trainer.precision=16-mixed: ModelParallelStrategy"),
], ids=["type", "unknown-flag", "no-config-file", "model-size", "init-from", "fp16-under-tp"])
def test_a_bad_config_is_a_user_error_naming_the_flag(args, message):
    with pytest.raises(UserError) as e:
        read_training_config(args)
    assert message in str(e.value)


def test_trainer_max_steps_is_the_schedule_length(monkeypatch):
    """One number: cli.py links trainer.max_steps into model.max_steps, so a shortened run ends its cosine at min_lr."""
    monkeypatch.chdir(ROOT)
    from gpt_tp.cli.config import _ParseOnly

    cfg = _ParseOnly(["--config", "configs/cpu.yaml", "--trainer.max_steps", "30"]).config
    assert cfg.model.max_steps == cfg.trainer.max_steps == 30


@pytest.mark.parametrize("short", ["CSVLogger", "TensorBoardLogger"])
def test_lightning_short_logger_names_are_lightnings(monkeypatch, short):
    """`--trainer.logger=CSVLogger` is Lightning's class: gpt_tp's own loggers have names of their own (Held...), as
    has its checkpoint callback (`--trainer.callbacks+=ModelCheckpoint` is Lightning's)."""
    monkeypatch.chdir(ROOT)
    from gpt_tp.cli.config import _ParseOnly

    cfg = _ParseOnly(["--config", "configs/cpu.yaml", f"--trainer.logger={short}",
                       "--trainer.logger.save_dir=logs"]).config
    assert cfg.trainer.logger.class_path == f"lightning.pytorch.loggers.{short}"
    default = _ParseOnly(["--config", "configs/cpu.yaml"]).config.trainer.logger
    assert default[0]["class_path"] == "gpt_tp.train.logs.HeldCSVLogger"
    callbacks = _ParseOnly(["--config", "configs/cpu.yaml", "--trainer.callbacks+=ModelCheckpoint",
                            "--trainer.callbacks.dirpath=ckpt"]).config.trainer.callbacks
    assert [c.class_path for c in callbacks][::4] == ["gpt_tp.checkpoint.AtomicModelCheckpoint",
                                                      "lightning.pytorch.callbacks.ModelCheckpoint"]
