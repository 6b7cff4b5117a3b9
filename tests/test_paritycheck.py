"""The parity command (python -m benchmarks.paritycheck under torchrun, gloo): passes gpt_tp's plan, catches broken ones."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, one_error_line
from gpt_tp.model import GPTConfig
from benchmarks.paritycheck import ParityInputError, load_plan, parser, settings


def paritycheck(nproc: int, *args: str, tmp_path=None) -> tuple[int, str, dict | None]:
    out = None if tmp_path is None else tmp_path / "parity.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "benchmarks.paritycheck", *args, *(["--json", str(out)] if out else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    res = json.loads(out.read_text()) if out is not None and out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, res


@pytest.fixture(scope="module")
def cpu_yaml_tp2(tmp_path_factory):
    """The parity check of configs/cpu.yaml (tiny's shape, DP=1 x TP=2) with batch 2 on 2 processes: gpt_tp's plan at
    TP=2 (test_gpt_tp_plan_passes[tp2]) and the training config's reading (test_training_config), one run."""
    return paritycheck(2, "--config", "configs/cpu.yaml", "--batch-size", "2", tmp_path=tmp_path_factory.mktemp("parity"))


@pytest.mark.parametrize("nproc,layout", [(2, None), (4, ["--model", "tiny", "--dp", "2", "--tp", "2"])],
                         ids=["tp2", "dp2xtp2"])
@pytest.mark.slow
def test_gpt_tp_plan_passes(tmp_path, nproc, layout, request):
    """TP=2: configs/cpu.yaml's model and layout (the tiny model's shape); DP=2 x TP=2: --model tiny."""
    if layout is None:
        rc, out, res = request.getfixturevalue("cpu_yaml_tp2")
    else:
        rc, out, res = paritycheck(nproc, *layout, tmp_path=tmp_path)
    assert rc == 0, out[-3000:]
    assert "PASS" in out and res["ok"]
    assert len(res["grads"]) == 28 and max(res["grads"].values()) < 1e-5
    assert max(res["weights"].values()) == 0.0
    assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-6)


@pytest.mark.slow
def test_training_config(cpu_yaml_tp2):
    rc, out, res = cpu_yaml_tp2
    assert rc == 0, out[-3000:]
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "cpu.yaml").read_text())
    m, strat, T = cfg["model"]["model"], cfg["trainer"]["strategy"]["init_args"], cfg["data"]["seq_len"]
    assert f"n_layer={m['n_layer']} n_head={m['n_head']} n_embd={m['n_embd']}" in out
    assert f"DP={strat['data_parallel_size']} x TP={strat['tensor_parallel_size']}" in out and f"batch 2x{T}" in out


@pytest.mark.slow
def test_naive_fused_qkv_is_caught(tmp_path):
    rc, out, res = paritycheck(2, "--model", "tiny", "--plan", "tests.workers.paritycheck_plans:naive_qkv", tmp_path=tmp_path)
    assert rc != 0 and "FAIL" in out and not res["ok"]
    # exactly the fused projections are named: their gathered weights are permuted
    assert {n for n, v in res["weights"].items() if v > 1e-4} == {f"transformer.h.{i}.attn.c_attn.weight" for i in (0, 1)}  # biases start at 0
    assert max(res["grads"].values()) > 0.1  # wrong by O(1), not by rounding
    assert abs(res["loss"] - res["ref_loss"]) > 1e-3


@pytest.mark.slow
def test_swapped_styles_are_caught():
    rc, out, _ = paritycheck(2, "--model", "tiny", "--plan", "tests.workers.paritycheck_plans:swapped_mlp")
    assert rc != 0 and "the tensor-parallel model did not run: RuntimeError" in out


def test_bad_input(command_here):
    args = parser().parse_args(["--model", "tiny", "--tp", "4"])
    with pytest.raises(ParityInputError, match="--dp 1 x --tp 4 = 4 but torchrun started 2 processes"):
        settings(args, world=2)
    with pytest.raises(ParityInputError, match=r"tensor-parallel size 3 must divide n_head=4 .* \(--tp, --dp, --seq-len\)"):
        settings(parser().parse_args(["--model", "tiny"]), world=3)
    with pytest.raises(ParityInputError, match="is not a dict of module path -> ParallelStyle"):
        load_plan("tests.workers.paritycheck_plans:not_a_plan", GPTConfig.from_name("tiny"))
    with pytest.raises(ParityInputError, match="must be module:attribute"):
        load_plan("TP_PLAN", GPTConfig.from_name("tiny"))
    with pytest.raises(ParityInputError, match="no such file"):
        settings(parser().parse_args(["--config", "configs/nope.yaml"]), world=2)
    with pytest.raises(ParityInputError, match="--layers=0 must be >= 1"):  # no block: a PASS would check nothing
        settings(parser().parse_args(["--model", "tiny", "--layers", "0"]), world=2)
    with pytest.raises(ParityInputError, match="--dp 3 does not divide the 2 processes"):
        settings(parser().parse_args(["--model", "tiny", "--dp", "3"]), world=2)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.paritycheck"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: run this command under torchrun")
    from benchmarks.paritycheck import main  # as its __main__ runs it, in this process (conftest's command_here)

    assert "error: unrecognized arguments: --tpp 2" in one_error_line(command_here(lambda: main(["--tpp", "2"])))


def test_config_reads_as_the_trainer_reads_it(tmp_path):
    """Two --config files stack as in cli.py fit; the classes' defaults fill what they leave out; "auto" DP is derived."""
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  devices: 4\n  strategy:\n    init_args: {data_parallel_size: auto}\n"
                     "model:\n  model: {n_layer: 3}\ndata:\n  batch_size: 3\n")
    s = settings(parser().parse_args(["--config", "configs/cpu.yaml", "--config", str(extra)]), world=4)
    assert (s["dp"], s["tp"], s["batch_size"], s["seq_len"]) == (2, 2, 3, 128)
    assert s["config"] == GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=128)
    bare = tmp_path / "bare.yaml"
    bare.write_text("model:\n  model: tiny\n")  # data.seq_len defaults to GPTDataModule's 1024 > block_size 128
    with pytest.raises(ParityInputError, match="--seq-len=1024 in 1..block_size=128"):
        settings(parser().parse_args(["--config", str(bare)]), world=2)
    with pytest.raises(ParityInputError, match=r"--config .*bare.yaml: .*unknown model size 'gpt5'"):
        bare.write_text("model:\n  model: gpt5\n")
        settings(parser().parse_args(["--config", str(bare)]), world=2)


def test_flags_replace_the_config_layout():
    """cpu.yaml says DP=1 x TP=2; --dp 2 on 2 processes means DP=2 x TP=1 (TP = processes / dp, as --help says)."""
    s = settings(parser().parse_args(["--config", "configs/cpu.yaml", "--dp", "2"]), world=2)
    assert (s["dp"], s["tp"]) == (2, 1)
    s = settings(parser().parse_args(["--config", "configs/cpu.yaml"]), world=2)
    assert (s["dp"], s["tp"]) == (1, 2)
    s = settings(parser().parse_args(["--config", "configs/cpu.yaml", "--tp", "1", "--dp", "2"]), world=2)
    assert (s["dp"], s["tp"]) == (2, 1)


def test_bad_input_under_torchrun_is_one_line():
    """Printed once for the two ranks; each worker exits 2 (torchrun itself then exits 1 with its own report)."""
    rc, out, _ = paritycheck(2, "--model", "tiny", "--layers", "0")
    assert rc != 0 and out.count("error: --layers=0 must be >= 1") == 1 and "PASS" not in out
    assert "exitcode  : 2 " in out
