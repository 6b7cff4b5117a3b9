"""Multi-node through Lightning's own multi-node environment, on this machine: each "node" is one start of the
worker with NODE_RANK, MASTER_ADDR and MASTER_PORT set, which spawns its processes (no torchrun)."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, WORKERS, read_json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(nodes: int, devices: int, tp: int, out, timeout: int = 600) -> dict:
    """Start the worker once per node (NODE_RANK 0..nodes-1, one MASTER_PORT), wait for all, fail with their output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "LOCAL_RANK", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, str(WORKERS / "multinode_fit.py"), "--nodes", str(nodes), "--devices", str(devices),
           "--tp", str(tp), "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "NODE_RANK": str(n)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for n in range(nodes)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # a node that hangs: end it with the processes it spawned (its own session)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for n, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode != 0:
            pytest.fail(f"node {n} failed ({p.returncode}):\n{log[-6000:]}")
    return read_json(f"{out}.json")


@pytest.mark.slow
def test_two_nodes_tp_inside_dp_across(tmp_path, one_node_of_4):
    """2 nodes x 2 processes, TP=2 inside a node, DP=2 across: the losses equal DP=2 x TP=2 on one node of 4, and
    no TP group spans two nodes."""
    one = one_node_of_4
    two = launch_nodes(2, 2, 2, tmp_path / "two")
    assert len(two["losses"]) == 4 and two["losses"][-1] < two["losses"][0]
    assert two["losses"] == one["losses"]
    ranks = {r["rank"]: r for r in two["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert len({r["pid"] for r in ranks.values()}) == 4
    for r in ranks.values():
        assert r["node_rank"] == r["env_node_rank"] == r["rank"] // 2 and r["local_rank"] == r["rank"] % 2
        assert len(r["tp_group"]) == 2 and {ranks[q]["node_rank"] for q in r["tp_group"]} == {r["node_rank"]}
        assert len(r["dp_group"]) == 2 and {ranks[q]["node_rank"] for q in r["dp_group"]} == {0, 1}
    assert {tuple(r["tp_group"]) for r in ranks.values()} == {(0, 1), (2, 3)}


@pytest.mark.slow
@pytest.mark.real_interpreter  # it counts node 1's processes with pgrep -s, which sees a zygote child's client only
def test_cli_node_started_first_waits_for_node_0():
    """`cli.py fit` on 2 "nodes" of 2 processes through Lightning's launcher (no Slurm, no torchrun), node 0 started
    35 s after node 1 has spawned its second process (past gpt_tp.cli.checks' 30 s rendezvous probe): node 1 waits in
    the process group, both train, and nothing blames torchrun's variables."""
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "LOCAL_RANK", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", "configs/cpu.yaml", "--trainer.num_nodes", "2",
           "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
           "--trainer.strategy.init_args.data_parallel_size", "2", "--trainer.max_steps", "2",
           "--model.total_batch_size", "2048", "--trainer.limit_val_batches", "0"]
    start = lambda node: subprocess.Popen(cmd, cwd=ROOT, env={**env, "NODE_RANK": str(node)}, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs = [start(1)]
    try:
        session = lambda: subprocess.run(["pgrep", "-s", str(procs[0].pid)], capture_output=True, text=True).stdout
        while len(session().split()) < 2 and procs[0].poll() is None:
            time.sleep(0.5)  # until Lightning's launcher has started node 1's local rank 1
        time.sleep(35)
        procs.append(start(0))
        for node, p in zip((1, 0), procs):  # node 1 first: if it gave up, node 0 would wait for it until killed
            log = p.communicate(timeout=600)[0]
            assert p.returncode == 0 and "torchrun" not in log, f"node {node} ({p.returncode}):\n{log[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
