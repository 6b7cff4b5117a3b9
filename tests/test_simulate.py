"""`python cli.py fit --config X --simulate`: one rank of the config's whole world on the fake process group with
fake tensors, through gpt_tp's own parallelize and training step, at the world sizes the shipped configs name."""

import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, one_error_line

pytestmark = pytest.mark.slow


def simulate(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), "fit", *args, "--simulate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table(proc) -> dict[str, list[float]]:
    """The simulated and planner rows: GiB by params, grads, optimizer, activations, temporaries, total."""
    rows = {}
    for name in ("simulated", "planner"):
        line = next(line for line in proc.stdout.splitlines() if re.match(rf"{name}\s+[\d.]+\s", line))
        rows[name] = [float(v) for v in line.split()[1:]]
    return rows


def collectives(proc) -> dict[tuple[str, str], int]:
    """The printed collectives: (process group, kind) -> count."""
    line = next(line for line in proc.stdout.splitlines() if line.startswith("collectives in one micro-batch"))
    counts = {}
    for group in line.split(": ", 1)[1].split("; "):
        name, ops = group.split(" ", 1)
        for op in ops.split(", "):
            kind, n = op.split()
            counts[name, kind] = int(n)
    return counts


AUTO = ["--trainer.strategy.init_args.data_parallel_size", "auto", "--trainer.strategy.init_args.tensor_parallel_size", "auto"]


@pytest.fixture(scope="module")
def simulated_auto():
    """`cli.py fit --config configs/<config> --simulate` with both sizes `auto`, run once per config for the tests that
    read it (the shipped configs' test and the Muon test's AdamW side)."""
    runs = {}

    def get(config: str) -> subprocess.CompletedProcess:
        if config not in runs:
            runs[config] = simulate("--config", f"configs/{config}", *AUTO, timeout=600)
        return runs[config]

    return get


# test_planner.py's test_planners_choice_runs_through_fit lives here (one --simulate per config asserts both): the
# shipped configs' own layouts are the planner's choices, which model.total_batch_size decides
@pytest.mark.parametrize("config, world, layout", [
    ("cpu.yaml", 2, "DP=1 x TP=2"),
    ("tp2.yaml", 2, "DP=1 x TP=2"),
    ("gpt2-xl-8gpu.yaml", 8, "DP=8 x TP=1"),
    ("multinode-2x8.yaml", 16, "DP=8 x TP=2"),
])
def test_shipped_configs_simulate(config, world, layout, simulated_auto):
    """Every shipped config with both sizes `auto`: `cli.py fit --simulate` (fit's launch checks, then one rank of the
    whole world on a fake process group) plans the planner command's choice for the same arguments, the config's
    own layout, and runs it. Each GPU config at its full world size on this CPU: exit 0 and rank 0's table. The
    simulated parameter, gradient and AdamW bytes equal the planner's (the same shards); the simulated peak, with the
    second micro-batch run beside the first one's gradients, is the planner's estimate within 1%; each process
    group's collectives are benchmarks.collectives.step_collectives' count (FSDP2's on data_parallel, the plan's on
    tensor_parallel)."""
    from gpt_tp.cli import planner as plan_command
    from gpt_tp.model import GPTConfig
    from benchmarks.collectives import step_collectives

    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == ["cpu.yaml", "gpt2-xl-8gpu.yaml",
                                                                         "multinode-2x8.yaml", "tp2.yaml"]
    p = plan_command.main(["--config", f"configs/{config}", *AUTO])
    proc = simulated_auto(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"gpt_tp planner: DP={p.choice.layout.dp} x TP={p.choice.layout.tp} " in proc.stderr
    assert f"simulated rank 0 of {p.world_size} (DP={p.choice.layout.dp} x TP={p.choice.layout.tp})" in proc.stdout
    cfg = yaml.safe_load((ROOT / "configs" / config).read_text())
    strat = cfg["trainer"]["strategy"]["init_args"]
    assert f"DP={strat['data_parallel_size']} x TP={strat['tensor_parallel_size']}" == layout
    assert f"simulated rank 0 of {world} ({layout})" in proc.stdout, proc.stdout
    if config == "cpu.yaml":  # the CPU demo: the planner's choice only, as test_planner checked it; no compile to skip
        assert "torch.compile" not in proc.stdout
        return
    rows = table(proc)
    held = "note: FSDP2 holds the unsharded float32 gradients" in proc.stdout  # accumulation at DP > 1
    assert held == (strat["data_parallel_size"] > 1 and cfg["trainer"]["accumulate_grad_batches"] > 1)
    for i in (0, 2) if held else (0, 1, 2):  # parameters, gradients, optimizer state
        assert rows["simulated"][i] == pytest.approx(rows["planner"][i], abs=0.011)
    if held:  # the tracker counts them among the activations or temporaries (the peak's total, below, holds them)
        assert rows["simulated"][1] == 0 and rows["planner"][1] > rows["planner"][0]
    assert rows["simulated"][5] == pytest.approx(rows["planner"][5], rel=0.01), proc.stdout
    assert "note: torch.compile skipped" in proc.stdout
    model, data = cfg["model"]["model"], cfg["data"]
    dp, tp = int(layout.split()[0][3:]), int(layout.split()[2][3:])
    expected = {(r["dim"], r["kind"]): r["count"] for r in step_collectives(
        GPTConfig.from_name(model), data["batch_size"], data["seq_len"], dp, tp, cfg["trainer"]["precision"])}
    assert collectives(proc) == expected, proc.stdout


def test_64_ranks_and_another_rank_and_a_memory_that_does_not_fit():
    """8 nodes x 8 devices, TP=8 x DP=8 (gpt2-medium's 16 heads and width, 8 of its 24 blocks: 2.2 GiB by the planner;
    the simulated step's work grows with the blocks), rank 9, against 2 GiB: the table for rank 9, then one error line
    saying the rank does not fit, exit 2."""
    proc = simulate("--config", "configs/multinode-2x8.yaml", "--trainer.num_nodes", "8", "--trainer.devices", "8",
                    "--trainer.strategy.init_args.tensor_parallel_size", "8", "--trainer.strategy.init_args.data_parallel_size", "8",
                    "--model.model", '{"n_layer": 8, "n_head": 16, "n_embd": 1024}', "--model.total_batch_size", "null",
                    "--simulate_rank", "9", "--simulate_memory_gib", "2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "simulated rank 9 of 64 (DP=8 x TP=8)" in proc.stdout and "does not fit 2 GiB per device" in proc.stdout
    rows = table(proc)
    assert rows["simulated"][5] == pytest.approx(rows["planner"][5], rel=0.01), proc.stdout
    assert re.fullmatch(r"error: rank 9 of DP=8 x TP=8 needs [\d.]+ GiB at its peak, more than 95% of 2 GiB: raise "
                        r"tensor_parallel_size, use more nodes, lower data.batch_size, or set model.activation_checkpointing",
                        one_error_line(proc))


def test_a_config_that_cannot_work_fails_as_a_launch_does(user_run):
    """TP=3 with cpu.yaml's 4 heads: the same one line as the real launch, exit 2 (the check is the launch's own
    GPTCLI._check_shapes); full checkpointing compiled at TP > 1 and a total batch that does not add up likewise.
    The launch and the first simulate are real processes; the other refusals come before any simulated rank, so they
    run cli.main in this process as cli.py's __main__ does (conftest's user_run: exit 2, one line, no traceback)."""
    import cli

    args = ["--config", "configs/cpu.yaml", "--trainer.devices", "6", "--trainer.strategy.init_args.tensor_parallel_size", "3"]
    simulated = one_error_line(simulate(*args))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launched = one_error_line(subprocess.run([sys.executable, str(ROOT / "cli.py"), "fit", *args], cwd=ROOT, env=env,
                                             capture_output=True, text=True, timeout=300))
    assert simulated == launched and "tensor_parallel_size=3" in simulated, (simulated, launched)

    def simulate_here(*args) -> str:
        return user_run(lambda: cli.main(["fit", *args, "--simulate"]))

    line = simulate_here("--config", "configs/multinode-2x8.yaml", "--trainer.strategy.init_args.tensor_parallel_size", "3")
    assert "trainer.strategy.init_args.tensor_parallel_size=3" in line, line
    # full checkpointing compiled at TP=2, and a total batch that B x T x DP x accumulation does not make: the lines
    # docs/errors.md gives for the launch
    assert simulate_here("--config", "configs/tp2.yaml", "--model.activation_checkpointing", "full",
                         "--model.compile", "true") == (
        "error: model.activation_checkpointing=full does not compile at tensor-parallel size > 1: use "
        "model.activation_checkpointing=selective, or model.compile=false")
    line = simulate_here("--config", "configs/multinode-2x8.yaml", "--model.total_batch_size", "4096")
    assert re.fullmatch(r"error: model\.total_batch_size=4096 tokens, but .* = 524288: choose .*", line), line


def test_muon_simulates_with_one_buffer_per_matrix(simulated_auto):
    """configs/tp2.yaml with --model.optimizer Muon: the simulated optimizer state equals the planner's (one momentum
    buffer per block matrix, AdamW's two moments for the rest), below AdamW's, and the step's collectives add Muon's
    (benchmarks.collectives.step_collectives with optimizer="muon"). AdamW's side: tp2.yaml as shipped (its optimizer
    is AdamW), the run test_shipped_configs_simulate reads, with the same DP=1 x TP=2."""
    from gpt_tp.model import GPTConfig
    from benchmarks.collectives import step_collectives

    muon, adamw = simulate("--config", "configs/tp2.yaml", "--model.optimizer", "Muon"), simulated_auto("tp2.yaml")
    assert muon.returncode == 0, muon.stderr[-3000:]
    assert adamw.returncode == 0, adamw.stderr[-3000:]
    for proc in (muon, adamw):
        assert "simulated rank 0 of 2 (DP=1 x TP=2)" in proc.stdout, proc.stdout
    rows = table(muon)
    assert rows["simulated"][2] == pytest.approx(rows["planner"][2], abs=0.011)
    assert rows["simulated"][2] < table(adamw)["simulated"][2] - 0.1
    cfg = yaml.safe_load((ROOT / "configs" / "tp2.yaml").read_text())
    expected = {(r["dim"], r["kind"]): r["count"] for r in step_collectives(
        GPTConfig.from_name(cfg["model"]["model"]), cfg["data"]["batch_size"], cfg["data"]["seq_len"], 1, 2,
        cfg["trainer"]["precision"], optimizer="muon")}
    assert collectives(muon) == expected, muon.stdout
