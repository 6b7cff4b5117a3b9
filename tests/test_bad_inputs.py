"""A new user's mistakes, through the commands' own entry (gpt_tp.entry.run, what `python cli.py ...` and
`python -m gpt_tp.X` run): each gives exit code 2, exactly one `error:` line naming the input and the fix, no
traceback, and leaves what was written before unchanged. The mistakes other test files already hold are listed
with theirs in docs/errors.md. Most cases fail before any process group starts, so they run in this process."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cli  # imported here, not under capsys: Lightning's log handlers keep the stream they first see
from conftest import ROOT, one_error_line

CPU = str(ROOT / "configs" / "cpu.yaml")
ONE_DEVICE = ("--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.devices", "1",
              "--trainer.strategy.init_args.tensor_parallel_size", "1")


def snapshot(path: Path) -> dict:
    """Every file under path (or path itself) -> sha1 of its bytes."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha1(p.read_bytes()).hexdigest() for p in files}


def cli_main(*args):
    return lambda: cli.main(list(args))


# ---- cli.py fit: config files, flags and values, all refused before any process starts ----------------------------
CONFIG_FILES = {
    "yaml-typo-key": ("data:\n  batchsize: 4\n", "does not accept option 'data.batchsize'"),
    "yaml-wrong-type": ("data:\n  batch_size: four\n", 'Parser key "data.batch_size"'),
    "yaml-syntax": ("data: [1, 2\n", "Problems parsing config"),
    "yaml-old-key": ("model:\n  muon_lr: 0.01\n", "error: Subcommand 'fit' does not accept option 'model.muon_lr'"),
    "yaml-model-max-steps": ("model:\n  max_steps: 19073\ntrainer:\n  max_steps: 100\n",
                             "my.yaml: model.max_steps follows trainer.max_steps (one number"),
}


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_bad_config_file(user_run, tmp_path, name):
    text, message = CONFIG_FILES[name]
    (tmp_path / "my.yaml").write_text(text)
    assert message in user_run(cli_main("fit", "--config", CPU, "--config", str(tmp_path / "my.yaml"), *ONE_DEVICE))


def test_tp_wider_than_a_node_is_refused(user_run):
    """TP=4 on 2 nodes of 2 devices (a TP group across nodes): --simulate and the launch give the same one line."""
    args = ("fit", "--config", CPU, "--trainer.logger", "false", "--trainer.devices", "2", "--trainer.num_nodes", "2",
            "--trainer.strategy.init_args.tensor_parallel_size", "4", "--trainer.strategy.init_args.data_parallel_size",
            "1", "--model.total_batch_size", "null")
    line = ("error: trainer.strategy.init_args.tensor_parallel_size=4, trainer.devices=2: tensor-parallel size 4 does "
            "not divide the 2 devices of a node, so a TP group would span nodes (TP stays inside a node: "
            "docs/scale.md); tensor-parallel sizes inside a node for this model: 1, 2")
    assert user_run(cli_main(*args, "--simulate")) == line
    assert user_run(cli_main(*args)) == line


def test_config_file_that_does_not_exist(user_run, tmp_path):
    assert f"File does not exist: '{tmp_path}/nope.yaml'" in user_run(cli_main("fit", "--config", str(tmp_path / "nope.yaml")))


FLAGS = {
    "batch-size-0": (["--data.batch_size", "0"], "data.batch_size=0 and data.seq_len=128 must be >= 1"),
    "seq-len-0": (["--data.seq_len", "0"], "data.batch_size=8 and data.seq_len=0 must be >= 1"),
    "val-batches-negative": (["--data.val_batches", "-1"], "val_batches and num_workers must be >= 0, got -1 and 0"),
    "max-lr-negative": (["--model.max_lr", "-1"], "model.max_lr=-1.0, model.min_lr=0.0003, model.warmup_steps=10: need max_lr > 0"),
    "warmup-negative": (["--model.warmup_steps", "-5"], "model.warmup_steps=-5: need max_lr > 0, 0 <= min_lr <= max_lr and warmup_steps >= 0"),
    "min-lr-above-max": (["--model.min_lr", "0.1"], "model.max_lr=0.003, model.min_lr=0.1, model.warmup_steps=10: need max_lr > 0, 0 <= min_lr <= max_lr"),
    "muon-lr-negative": (["--model.optimizer", "Muon", "--model.optimizer.lr", "-0.01"],
                         "model.optimizer.lr=-0.01: Muon's peak learning rate must be >= 0 (default 0.02)"),
    "optimizer-unknown": (["--model.optimizer", "sgd"], "model.optimizer=sgd: use one of AdamW, Muon (--model.optimizer Muon --model.optimizer.lr 0.02)"),
    "optimizer-old-name": (["--model.optimizer", "muon"], "model.optimizer=muon: use one of AdamW, Muon"),
    "muon-lr-old-flag": (["--model.muon_lr", "0.01"], "error: unrecognized arguments: --model.muon_lr 0.01 (see python cli.py fit --help)"),
    "betas-old-flag": (["--model.betas", "[0.9, 0.95]"], "error: unrecognized arguments: --model.betas [0.9, 0.95] (see python cli.py fit --help)"),
    "max-steps-zero": (["--trainer.max_steps", "0"], "trainer.max_steps=0: give the run's length in optimizer steps (>= 1)"),
    "model-max-steps": (["--model.max_steps", "30"], "model.max_steps follows trainer.max_steps (one number: the run's length and its learning-rate schedule's); set --trainer.max_steps only"),
    "n-layer-0": (["--model.model.n_layer", "0"], "model.n_layer=0: must be >= 1"),
    "num-nodes-0": (["--trainer.num_nodes", "0"], "`num_nodes` must be a positive integer, but got 0. (check the trainer.* settings)"),
    "val-check-0": (["--trainer.val_check_interval", "0"], "trainer.val_check_interval=0 must be > 0 (micro-batches, or a fraction of an epoch)"),
    "clip-negative": (["--trainer.gradient_clip_val", "-1"], "trainer.gradient_clip_val=-1 must be >= 0 (a norm; 0 or null: no clipping)"),
    "eps-negative": (["--model.optimizer.eps", "-1"], "model.optimizer.eps=-1.0: AdamW needs weight_decay >= 0, each beta in [0, 1) and eps > 0"),
    "weight-decay-negative": (["--model.optimizer.weight_decay", "-0.1"], "model.optimizer.weight_decay=-0.1, model.optimizer.betas=[0.9, 0.95], model.optimizer.eps=1e-08: AdamW needs"),
    "beta-above-1": (["--model.optimizer.betas", "[0.9, 1.5]"], "model.optimizer.betas=[0.9, 1.5], model.optimizer.eps=1e-08: AdamW needs"),
    "peak-flops-negative": (["--model.peak_flops", "-1"], "model.peak_flops=-1.0 must be > 0 (the device's peak FLOP/s), or null to detect it"),
    "seed-not-a-number": (["--seed_everything", "abc"], "seed_everything: expected one of bool, int; got 'abc'"),
    "precision-8": (["--trainer.precision", "8"], "trainer.precision: expected one of 64, 32, 16, transformer-engine, "
                    "transformer-engine-float16, 16-true, 16-mixed, bf16-true, bf16-mixed, 32-true, 64-true, bf16, null; got '8'"),
    "log-every-0": (["--trainer.log_every_n_steps", "0"], "trainer.log_every_n_steps=0: no training metric would be logged; give >= 1"),
    "accumulate-0": (["--trainer.accumulate_grad_batches", "0"], "trainer.accumulate_grad_batches=0 = 0: set trainer.accumulate_grad_batches=1"),
    "betas-one": (["--model.optimizer.betas", "[0.9]"], 'Parser key "betas": Expected a tuple with 2 elements. Got value: [0.9]'),
    "positional": (["extra"], "unrecognized arguments: extra (see python cli.py fit --help)"),
    "root-dir-unmakeable": (["--trainer.default_root_dir", "/proc/nope"], "trainer.default_root_dir: cannot create the log folder /proc/nope (No such file or directory)"),
    "n-head-not-dividing": (["--model.model.n_head", "3"], "model.n_embd=64 must be divisible by model.n_head=3"),
    "dropout-2": (["--model.model.dropout", "2.0"], "model.dropout=2.0 must be in [0, 1)"),
    "ac-mode": (["--model.activation_checkpointing", "some"], "model.activation_checkpointing='some': use one of none, full, selective"),
    "heap-split-policy": (["--trainer.callbacks", "gpt_tp.train.malloc.HeapSplit", "--trainer.callbacks.policy", "glibc"],
                          "HeapSplit(policy='glibc'): choose one of split, mmap"),
    "full-ac-compiled-at-tp2": (["--trainer.devices", "2", "--trainer.strategy.init_args.tensor_parallel_size", "2",
                                 "--model.compile", "true", "--model.activation_checkpointing", "full"],
                                "model.activation_checkpointing=full does not compile at tensor-parallel size > 1"),
    "devices-0": (["--trainer.devices", "0"], "`Trainer(devices='0')` value is not a valid input using cpu accelerator"),
    "hellaswag-every-negative": (["--trainer.callbacks", "gpt_tp.eval.hellaswag.HellaSwagCallback", "--trainer.callbacks.every_n_steps", "-1"],
                                 "HellaSwagCallback every_n_steps=-1 must be >= 0"),
    "hellaswag-batch-0": (["--trainer.callbacks", "gpt_tp.eval.hellaswag.HellaSwagCallback", "--trainer.callbacks.batch_size", "0"],
                          "HellaSwagCallback batch_size=0 and pad_to=32 must be >= 1"),
    "hellaswag-missing-file": (["--trainer.callbacks", "gpt_tp.eval.hellaswag.HellaSwagCallback", "--trainer.callbacks.path",
                                "no/such/hellaswag_val.jsonl"],
                               "no/such/hellaswag_val.jsonl not found: fetch it where there is internet (python -m "
                               "gpt_tp.eval.hellaswag_data writes data/hellaswag/hellaswag_val.jsonl) and copy it here"),
    "matmul-precision": (["--model.float32_matmul_precision", "tf32"],
                         "model.float32_matmul_precision=tf32: use highest, high (TF32 on CUDA) or medium"),
    "sampler-every-negative": (["--trainer.callbacks", "gpt_tp.infer.sampling.TextSampleCallback", "--trainer.callbacks.every_n_steps", "-2"],
                               "TextSampleCallback every_n_steps=-2 must be >= 0"),
}


@pytest.mark.parametrize("name", FLAGS)
def test_bad_flag_value(user_run, name):
    flags, message = FLAGS[name]
    assert message in user_run(cli_main("fit", "--config", CPU, *ONE_DEVICE, *flags))


def test_nested_flag_on_the_callback_list_is_one_short_line(user_run):
    """--trainer.callbacks.dirpath on cpu.yaml's list sets the last entry (HeapSplit): jsonargparse's Union error
    (600+ characters, one error per subtype) becomes its first error and what the flag did."""
    line = user_run(cli_main("fit", "--config", CPU, "--trainer.callbacks.dirpath", "elsewhere"))
    assert line == ("error: trainer.callbacks: Problem with given class_path 'gpt_tp.train.malloc.HeapSplit': Option 'dirpath' "
                    "is not accepted (--trainer.callbacks.dirpath sets dirpath on the last entry of trainer.callbacks; set it "
                    "in that entry of your config file instead) (see python cli.py fit --help)")


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def test_a_file_given_as_checkpoint_is_refused_and_kept(user_run, tmp_path):
    garbage = tmp_path / "model.ckpt"
    garbage.write_bytes(b"not a checkpoint\n" * 60)  # fixed bytes: random ones fail in pickle in varying ways
    before = snapshot(garbage)
    line = user_run(cli_main("fit", "--config", CPU, *ONE_DEVICE, "--ckpt_path", str(garbage)))
    assert f"{garbage} is a file, not a distributed checkpoint folder" in line
    assert snapshot(garbage) == before


@pytest.mark.slow
def test_checkpoint_of_another_size_through_cli_leaves_it_unchanged(ckpt):
    """The real `python cli.py validate` with a --model.model flag the checkpoint disagrees with: refused before
    launch in one line naming both values, the folder unchanged (the load's own check: test_checkpoint.py)."""
    saved, _ = ckpt
    before = snapshot(saved)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "validate", "--config", CPU, *ONE_DEVICE, "--model.model.n_layer",
                           "3", "--ckpt_path", str(saved)], cwd=saved.parent.parent, env=env, capture_output=True, text=True, timeout=300)
    line = one_error_line(proc)
    assert line == (f"error: --model.model.n_layer=3, but {saved} was trained with model.model.n_layer=2: drop the "
                    "flag (the checkpoint's value is used), or start a new run")
    assert snapshot(saved) == before


def test_distributed_checkpoint_under_a_one_file_strategy(user_run, ckpt):
    """A distributed checkpoint folder given to a one-process strategy (--trainer.strategy auto or ddp), which reads
    files: one line naming ModelParallel on one device, before launch (loading a file into ModelParallel:
    tests/test_user_paths.py::test_one_file_checkpoint_of_a_single_device_run_loads_into_tensor_parallel)."""
    saved, _ = ckpt
    for strategy in ("auto", "ddp"):
        line = user_run(cli_main("validate", "--config", CPU, *ONE_DEVICE, "--trainer.strategy", strategy,
                                 "--ckpt_path", str(saved)))
        assert line == (f"error: --ckpt_path {saved} is a distributed checkpoint folder, which trainer.strategy="
                        f"{'SingleDeviceStrategy' if strategy == 'auto' else 'DDPStrategy'} cannot load: load it on one "
                        "device with --trainer.strategy gpt_tp.checkpoint.ModelParallel "
                        "--trainer.strategy.init_args.tensor_parallel_size 1")


def test_checkpoint_folders_given_for_the_wrong_flag(user_run, ckpt):
    """The folder holding the checkpoints given as --ckpt_path names its last.ckpt; a checkpoint given where a
    Hugging Face folder belongs (model.init_from) names --ckpt_path."""
    saved, _ = ckpt
    line = user_run(cli_main("validate", "--config", CPU, *ONE_DEVICE, "--ckpt_path", str(saved.parent)))
    assert line == f"error: {saved.parent} is a folder of checkpoints (1), not one: give {saved}, or 'last'"
    expected = f"error: {saved} is a gpt_tp checkpoint, not a Hugging Face folder: give it as --ckpt_path, or export it first"
    assert user_run(cli_main("fit", "--config", CPU, *ONE_DEVICE, "--model.init_from", str(saved))).startswith(expected)


def test_truncated_checkpoint_folder(user_run, ckpt, tmp_path):
    saved, _ = ckpt
    from gpt_tp.checkpoint.export import main as export_main

    broken = tmp_path / "broken.ckpt"
    shutil.copytree(saved, broken)
    (broken / "meta.pt").unlink()
    before = snapshot(broken)
    line = user_run(lambda: export_main([str(broken), "--out", str(tmp_path / "out")]))
    assert f"{broken} is not a complete distributed checkpoint: meta.pt missing" in line
    assert snapshot(broken) == before and not (tmp_path / "out").exists()


# ---- Hugging Face folders (model.init_from) ------------------------------------------------------------------
def _edit_config(**fields):
    def edit(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(fields)
        (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return edit


def _drop_tensor(d: Path):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    del sd["transformer.h.1.mlp.c_fc.weight"]
    save_file(sd, str(d / "model.safetensors"))


HF_FOLDERS = {
    "config-not-json": (lambda d: (d / "config.json").write_text("{not json"), "config.json: not a GPT-2 config.json (JSONDecodeError"),
    "model-type-bert": (_edit_config(model_type="bert"), "config.json: expected a GPT-2 checkpoint (model_type 'gpt2'), got model_type='bert'"),
    "n-head-not-dividing": (_edit_config(n_head=3), "config.json: model.n_embd=64 must be divisible by model.n_head=3"),
    "field-missing": (_edit_config(n_layer=None), "config.json: GPT-2 config fields n_layer missing"),
    "tensor-missing": (_drop_tensor, "model.safetensors does not fit {d}/config.json: transformer.h.1.mlp.c_fc.weight missing"),
    "more-layers-than-weights": (_edit_config(n_layer=3), "model.safetensors does not fit {d}/config.json: transformer.h.2.ln_1.weight missing"),
    "wider-than-weights": (_edit_config(n_embd=128), "transformer.h.0.attn.c_attn.bias: (192,) vs config (384,)"),
    "safetensors-garbage": (lambda d: (d / "model.safetensors").write_bytes(b"not safetensors\n" * 30), "model.safetensors is unreadable ("),
}


@pytest.mark.parametrize("name", HF_FOLDERS)
def test_bad_hugging_face_folder(user_run, ckpt, tmp_path, name):
    edit, message = HF_FOLDERS[name]
    d = tmp_path / "hf"
    shutil.copytree(ckpt[1], d)
    edit(d)
    message = message.format(d=d)
    assert message in user_run(cli_main("fit", "--config", CPU, *ONE_DEVICE, "--model.init_from", str(d)))


# ---- cli.py predict: prompts and its output, before any rank starts -------------------------------------------------
def test_bad_prompts(user_run, tmp_path):
    predict = ("predict", "--config", CPU, *ONE_DEVICE)
    assert "--prompt: an empty prompt; give text to continue" in user_run(cli_main(*predict, "--prompt", ""))
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    assert f"--prompts_file {tmp_path}/blank.txt: holds no prompt" in user_run(cli_main(*predict, "--prompts_file", str(tmp_path / "blank.txt")))
    assert "--prompts_file nope.txt: no such file" in user_run(cli_main(*predict, "--prompts_file", "nope.txt"))
    assert "--max_new_tokens=0, --num_samples=1 and --top_k=50 must be >= 1" in user_run(cli_main(*predict, "--max_new_tokens", "0"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00binary")
    assert f"--prompts_file {tmp_path}/bin.txt: not UTF-8 text (invalid start byte at byte 0)" in user_run(
        cli_main(*predict, "--prompts_file", str(tmp_path / "bin.txt")))
    # an --output that cannot be written is refused before launch, not after every prompt has been continued
    (tmp_path / "plain").write_text("mine")
    assert f"--output {tmp_path}/plain/x.jsonl: cannot create its folder {tmp_path}/plain (File exists)" in user_run(
        cli_main(*predict, "--prompt", "hi", "--output", str(tmp_path / "plain" / "x.jsonl")))


LONG_PROMPT = "word" + " word" * 120  # 121 tokens of block_size's 128


@pytest.fixture(scope="module")
def predicted(ckpt, tmp_path_factory):
    """One real `cli.py predict` on one process, shared by the two tests below: over an existing --output with
    --overwrite_output, its prompts from a --prompts_file that starts with a UTF-8 byte-order mark and ends with a
    prompt nearly as long as block_size, 40 new tokens each (top_k 1). Its output's rows."""
    tmp = tmp_path_factory.mktemp("predict")
    prompts = tmp / "prompts.txt"
    prompts.write_bytes(f"ROMEO:\nTo be\n{LONG_PROMPT}\n".encode("utf-8-sig"))
    out = tmp / "pred.jsonl"
    out.write_text("mine\n")
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "predict", "--config", CPU, *ONE_DEVICE, "--ckpt_path",
                           str(ckpt[0]), "--prompts_file", str(prompts), "--max_new_tokens", "40", "--top_k", "1",
                           "--output", str(out), "--overwrite_output"],
                          cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_long_prompt_slides_its_window(predicted, enc):
    """A prompt nearly as long as block_size (121 of 128 tokens) still gets the 40 new tokens asked for: the
    context slides to its last block_size tokens, as nanoGPT's generate does."""
    assert len(enc.encode(LONG_PROMPT)) == 121
    row = predicted[-1]
    assert row["prompt"] == LONG_PROMPT and row["text"].startswith(LONG_PROMPT)
    assert len(enc.encode(row["text"][len(LONG_PROMPT):])) >= 30  # about 40 (re-encoding may merge a few); not ~7


def test_predict_keeps_an_existing_output_and_drops_a_bom(user_run, ckpt, predicted, tmp_path):
    """--output naming an existing file is refused before launch (file unchanged) unless --overwrite_output; a UTF-8
    byte-order mark in --prompts_file is not part of the first prompt."""
    from gpt_tp.infer.predict import Prompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("ROMEO:\nTo be\n".encode("utf-8-sig"))
    assert Prompts(prompts_file=str(prompts)).read() == ["ROMEO:", "To be"]
    out = tmp_path / "pred.jsonl"
    out.write_text("mine\n")
    predict = ("predict", "--config", CPU, *ONE_DEVICE, "--ckpt_path", str(ckpt[0]), "--prompts_file", str(prompts),
               "--max_new_tokens", "2", "--output", str(out))
    assert user_run(cli_main(*predict)) == (f"error: --output {out} exists; give a new file, or pass "
                                            "--overwrite_output to replace it")
    assert out.read_text() == "mine\n"
    # the fixture's real run with --overwrite_output replaced its "mine" file (not JSON) with every prompt's row
    assert [row["prompt"] for row in predicted] == ["ROMEO:", "To be", LONG_PROMPT]


def test_exported_safetensors_has_the_umasks_mode(ckpt):
    umask = os.umask(0)
    os.umask(umask)
    modes = [(ckpt[1] / name).stat().st_mode & 0o777 for name in ("model.safetensors", "config.json")]
    assert modes == [0o666 & ~umask] * 2


# ---- validate and predict never score the random init -------------------------------------------------------------
def test_untrained_weights_refused(user_run, tmp_path):
    for sub in ("validate", "predict"):
        line = user_run(cli_main(sub, "--config", CPU, *ONE_DEVICE))
        assert f"cli.py {sub} would use untrained weights: give --ckpt_path (a checkpoint folder, or 'last') or --model.init_from" in line
    empty = tmp_path / "ckpt"
    line = user_run(cli_main("validate", "--config", CPU, *ONE_DEVICE[:-4], "--trainer.devices", "1",
                             "--trainer.strategy.init_args.tensor_parallel_size", "1",
                             "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
                             "--trainer.callbacks.dirpath", str(empty), "--ckpt_path", "last"))
    assert f"--ckpt_path last: no checkpoint in {empty} yet; give a checkpoint folder, or train one first" in line
    assert not empty.exists()


# ---- checkpoint folders are checked before launch, not at the first save --------------------------------------------
def test_checkpoint_folder_under_a_file(user_run, tmp_path):
    (tmp_path / "plain").write_text("mine")
    before = snapshot(tmp_path)
    line = user_run(cli_main("fit", "--config", CPU, *ONE_DEVICE[:-4], "--trainer.devices", "1",
                             "--trainer.strategy.init_args.tensor_parallel_size", "1",
                             "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
                             "--trainer.callbacks.dirpath", str(tmp_path / "plain" / "ckpt")))
    assert f"ModelCheckpoint dirpath: cannot create the checkpoint folder {tmp_path}/plain/ckpt (Not a directory)" in line
    assert snapshot(tmp_path) == before


# ---- an output that names a folder: refused, the folder unchanged ------------------------------------------------
def test_outputs_naming_a_folder(user_run, tmp_path):
    from gpt_tp.train.plot import main as plot_main

    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    line = user_run(cli_main("predict", "--config", CPU, *ONE_DEVICE, "--prompt", "Hello", "--output", str(folder)))
    assert f"--output {folder} is a folder; give the name of a file" in line
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train/loss\n0,0,10.5\n0,1,9.5\n")
    before[str(metrics)] = hashlib.sha1(metrics.read_bytes()).hexdigest()
    line = user_run(lambda: plot_main([str(metrics), "--out", str(folder)]))
    assert f"--out {folder} is a folder; give a PNG file name, e.g. --out {folder}/run.png" in line
    assert snapshot(tmp_path) == before  # nothing written beside the folder either (matplotlib would add .png)


@pytest.mark.slow
def test_a_callback_refusing_on_every_rank_prints_once():
    """The real `python cli.py fit` at TP=2: TextSampleCallback checks its prompt's length in setup, on both ranks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "cli.py", "fit", "--config", CPU, "--trainer.logger", "false", "--trainer.max_steps", "2",
                           "--trainer.enable_checkpointing", "false", "--trainer.callbacks",
                           "gpt_tp.infer.sampling.TextSampleCallback", "--trainer.callbacks.max_length", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "TextSampleCallback max_length=2 must exceed the prompt's token count: raise max_length" in one_error_line(proc)


# ---- each command's own flags: one error line naming the flag, exit 2 ----------------------------------------------
@pytest.mark.parametrize("command,args,message", [
    ("gpt_tp.checkpoint.export", ["ckpt", "--out", "x", "--format", "zip"],
     "argument --format: invalid choice: 'zip' (choose from 'torch', 'hf', 'both') (see python -m gpt_tp.checkpoint.export --help)"),
    ("gpt_tp.cluster.slurm", ["latest", "checkpoints", "--newest"],
     "unrecognized arguments: --newest (see python -m gpt_tp.cluster.slurm --help)"),
], ids=["export", "slurm"])
def test_bad_command_line(user_run, command, args, message):
    from importlib import import_module

    assert message in user_run(lambda: import_module(command).main(args))


def test_no_subcommand(user_run):
    assert "error: expected \"subcommand\" to be one of {fit,validate,predict}" in user_run(cli_main())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the mistake is a GPU config on a machine without one")
def test_gpu_config_on_a_cpu_machine(user_run):
    assert user_run(cli_main("fit", "--config", str(ROOT / "configs" / "tp2.yaml"))) == (
        "error: trainer.accelerator=gpu: this machine has no GPU; use configs/cpu.yaml or --trainer.accelerator cpu")


def test_export_into_an_unmakeable_folder(user_run, ckpt, tmp_path):
    from gpt_tp.checkpoint.export import main as export_main

    (tmp_path / "plain").write_text("mine")
    assert user_run(lambda: export_main([str(ckpt[0]), "--out", str(tmp_path / "plain" / "x")])) == (
        f"error: --out {tmp_path}/plain/x: cannot create it (Not a directory); choose a --out in a writable folder")
    assert (tmp_path / "plain").read_text() == "mine"


def test_slurm_latest_names_a_missing_folder(tmp_path, capsys):
    """`latest` prints nothing on stdout when there is no checkpoint (the sbatch scripts then start from step 0),
    and says why on stderr, so a mistyped folder is not a silent fresh start."""
    from gpt_tp.cluster.slurm import main as slurm_main

    assert slurm_main(["latest", str(tmp_path / "chekpoints")]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"gpt_tp: no complete checkpoint in {tmp_path}/chekpoints ({tmp_path}/chekpoints: no such folder)\n"
