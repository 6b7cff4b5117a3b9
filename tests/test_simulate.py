"""`python cli.py fit --config X --simulate`: one rank of the config's whole world on the fake process group with
fake tensors, through gpt_tp's own parallelize and training step, at the world sizes the shipped configs name."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, one_error_line

pytestmark = pytest.mark.slow


def simulate(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), "fit", *args, "--simulate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table(proc) -> dict[str, list[float]]:
    """The simulated and planner rows: GiB by params, grads, optimizer, activations, temporaries, total."""
    rows = {}
    for name in ("simulated", "planner"):
        line = next(line for line in proc.stdout.splitlines() if re.match(rf"{name}\s+[\d.]+\s", line))
        rows[name] = [float(v) for v in line.split()[1:]]
    return rows


@pytest.mark.parametrize("config, world, layout", [
    ("tp2.yaml", 2, "DP=1 x TP=2"),
    ("multinode-2x8.yaml", 16, "DP=8 x TP=2"),
])
def test_shipped_configs_simulate(config, world, layout):
    """Each shipped config at its full world size on this CPU: exit 0 and rank 0's table. The simulated parameter
    and AdamW bytes equal the planner's (the same shards); activations and the total are printed beside it."""
    proc = simulate("--config", f"configs/{config}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"simulated rank 0 of {world} \(DP=\d+ x TP=\d+\)", proc.stdout), proc.stdout
    if layout:
        assert f"of {world} ({layout})" in proc.stdout
    rows = table(proc)
    for i in (0, 2):  # parameters, optimizer state
        assert rows["simulated"][i] == pytest.approx(rows["planner"][i], abs=0.011)
    assert rows["simulated"][5] > 0 and "note: torch.compile skipped" in proc.stdout
    if config == "tp2.yaml":  # TP only: the step's collectives are gpt_tp.sizing.sizes.step_collectives' count
        from gpt_tp.model import GPTConfig
        from gpt_tp.sizing.sizes import step_collectives

        expected = {r["kind"]: r["count"] for r in step_collectives(GPTConfig.from_name("gpt2"), 16, 1024, 1, 2, "bf16-mixed")}
        line = next(line for line in proc.stdout.splitlines() if line.startswith("collectives in one step"))
        assert (f"c10d.allreduce_ {expected['all_reduce']}, c10d_functional.all_gather_into_tensor {expected['all_gather']}, "
                f"c10d_functional.reduce_scatter_tensor {expected['reduce_scatter']}") in line


def test_64_ranks_and_another_rank_and_a_memory_that_does_not_fit():
    """8 nodes x 8 devices, TP=8 x DP=8 (gpt2-medium: 16 heads), rank 9, against 2 GiB: the table for rank 9, then one
    error line saying the rank does not fit, exit 2."""
    proc = simulate("--config", "configs/multinode-2x8.yaml", "--trainer.num_nodes", "8", "--trainer.devices", "8",
                    "--trainer.strategy.init_args.tensor_parallel_size", "8", "--trainer.strategy.init_args.data_parallel_size", "8",
                    "--model.model", "gpt2-medium", "--model.total_batch_size", "null", "--simulate_rank", "9",
                    "--simulate_memory_gib", "2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "simulated rank 9 of 64 (DP=8 x TP=8)" in proc.stdout and "does not fit 2 GiB per device" in proc.stdout
    assert re.fullmatch(r"error: rank 9 of DP=8 x TP=8 needs [\d.]+ GiB at its peak, more than 95% of 2 GiB: raise "
                        r"tensor_parallel_size, use more nodes, lower data.batch_size, or set model.activation_checkpointing",
                        one_error_line(proc))


def test_a_config_that_cannot_work_fails_as_a_launch_does():
    """TP=3 with cpu.yaml's 4 heads: the same one line as the real launch, exit 2 (the check is the launch's own
    GPTCLI._check_shapes, which also refuses full checkpointing compiled at TP > 1)."""
    args = ["--config", "configs/cpu.yaml", "--trainer.devices", "6", "--trainer.strategy.init_args.tensor_parallel_size", "3"]
    simulated = one_error_line(simulate(*args))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launched = one_error_line(subprocess.run([sys.executable, str(ROOT / "cli.py"), "fit", *args], cwd=ROOT, env=env,
                                             capture_output=True, text=True, timeout=300))
    assert simulated == launched and "tensor_parallel_size=3" in simulated, (simulated, launched)
    proc = simulate("--config", "configs/multinode-2x8.yaml", "--trainer.strategy.init_args.tensor_parallel_size", "3")
    assert proc.returncode == 2 and "trainer.strategy.init_args.tensor_parallel_size=3" in one_error_line(proc)
