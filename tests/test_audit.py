"""The audit command (python -m benchmarks.audit) at TP=2, DP=2 x TP=2 and DP=2 x TP=1 (gloo), against numbers
derived by hand. It runs the benchmark's training step (benchmarks.step.train_step) with each phase recorded.

Megatron's sequence parallelism for L blocks on the TP group (derivation in benchmarks/collectives.py):
  all_gather 6L + 3   (per block: before attention and MLP in forward; in backward the same inputs again, for the
                       weight gradients, and the reduce-scatters' grads; + lm_head's sequence gather in forward and
                       again in backward, + the embedding's grad in backward)
  reduce_scatter 4L + 2 (mirror image: after attention and MLP; + the embedding in forward, + lm_head in backward)
  all_reduce 3        (2 in vocab-parallel cross-entropy: the max, then the sum of exps with the target logit;
                       1 flat one for the sequence-partial grads)
FSDP2 on the DP group (L block units + the root): all_gather 2L + 1 (each unit before forward, each block again
before backward), reduce_scatter L + 1. The grad norm: 1 all_reduce over the whole mesh.
"""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, one_error_line, read_json, run_torchrun

from benchmarks import collectives
from gpt_tp.model import GPTConfig


def audit(tmp_path, nproc: int, *args: str) -> dict:
    """python -m benchmarks.audit on nproc processes (the tiny model, T=64); its JSON report. The command exits 0
    only when the measurement equals the model of benchmarks.collectives."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "benchmarks.audit", "--model", "tiny", "--seq-len", "64", "--json", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "audit: the step communicates and stores what the model says" in proc.stdout
    r = read_json(out)
    assert r["differences"] == []
    return r


# The 2-process runs of the tests below but tp2_audit's, in one launch (tests/workers/audits.py: the command's main for
# each in turn), made on first use. On 2 processes every mesh dimension of size 2 is the whole world's group, so no run
# meets a group of an earlier run's mesh; on 4 a second DP=2 x TP=2 run recorded a TP all-reduce on the first run's
# group, so each 4-process run has a launch of its own.
SHARED_2 = [("--layers", "3"), ("--dp", "2", "--layers", "2", "--batch-size", "2"), ("--dp", "1", "--optimizer", "muon", "--batch-size", "2")]


@pytest.fixture(scope="module")
def shared_audit(tmp_path_factory):
    """shared_audit(nproc, *args): the audit's JSON report for those arguments on nproc processes: SHARED_2's launch,
    or (4 processes) a launch of its own."""
    done = []

    def get(nproc: int, *args: str) -> dict:
        if nproc != 2:
            return audit(tmp_path_factory.mktemp("audit"), nproc, *args)
        if not done:
            tmp, argv = tmp_path_factory.mktemp("audits2"), []
            for i, run_args in enumerate(SHARED_2):
                argv += [*(["--then"] if argv else []), "--model", "tiny", "--seq-len", "64", "--json", str(tmp / f"{i}.json"), *run_args]
            proc = run_torchrun("audits.py", 2, *argv)  # exits 0 only when every run's measurement is the model's
            assert proc.stdout.count("audit: the step communicates and stores what the model says") == len(SHARED_2)
            done.extend(read_json(tmp / f"{i}.json") for i in range(len(SHARED_2)))
        r = done[SHARED_2.index(args)]
        assert r["differences"] == []
        return r

    return get


@pytest.fixture(scope="module")
def tp2_audit(tmp_path_factory):
    """The audit at TP=2 of the tiny model as it is (L = 2 blocks, B = 1): read by the L = 2 case of
    test_collectives_equal_megatron and by test_state_bytes_halve."""
    return audit(tmp_path_factory.mktemp("audit_tp2"), 2)


@pytest.mark.parametrize("n_layer", [2, 3])
@pytest.mark.slow
def test_collectives_equal_megatron(shared_audit, n_layer, request):
    r = request.getfixturevalue("tp2_audit") if n_layer == 2 else shared_audit(2, "--layers", str(n_layer))
    assert r["n_layer"] == n_layer
    L, c = n_layer, r["measured"]["collectives"]
    megatron = {"all_gather": 6 * L + 3, "reduce_scatter": 4 * L + 2, "all_reduce": 4}
    assert r["modeled"]["by_group"] == {"tensor_parallel": megatron}
    assert c["total"] == megatron
    assert c["forward"] == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": 2}
    assert c["backward"] == {"all_gather": 4 * L + 2, "reduce_scatter": 2 * L + 1}
    assert c["grad_sync_and_clip"] == {"all_reduce": 2}
    assert c["optimizer"] == {}  # no hidden per-parameter reductions inside the fused AdamW step
    # bytes, float32, B=1, T=64, C=64: every all-gather and reduce-scatter moves one (B, T, C) activation; the
    # all-reduces: wpe (128 x 64) and the 2L + 1 LayerNorms' (2 x 64) gradients, the loss's 12 bytes per token
    # (the max, then the sum of exps with the target logit), the 4-byte grad norm
    act = 1 * 64 * 64 * 4
    rows = {row["kind"]: row["bytes"] for row in r["measured"]["collective_rows"]}
    assert rows == {"all_gather": (6 * L + 3) * act, "reduce_scatter": (4 * L + 2) * act,
                    "all_reduce": 4 * (128 * 64 + (2 * L + 1) * 2 * 64) + 64 * 12 + 4}


@pytest.mark.parametrize("dp,tp,n_layer", [(2, 2, 3), (2, 1, 2)], ids=["dp2xtp2", "dp2xtp1"])
@pytest.mark.slow
def test_dp_collectives_equal_minimum(shared_audit, dp, tp, n_layer):
    """No per-parameter all-reduce inside FSDP2's backward, one flat all-reduce of the sequence-partial gradients
    over TP, one grad-norm all-reduce over the whole mesh."""
    r = shared_audit(dp * tp, "--dp", str(dp), "--layers", str(n_layer), "--batch-size", "2")
    L, c = n_layer, r["measured"]["collectives"]
    expected = {"data_parallel": {"all_gather": 2 * L + 1, "reduce_scatter": L + 1}}
    if tp > 1:
        expected["tensor_parallel"] = {"all_gather": 6 * L + 3, "reduce_scatter": 4 * L + 2, "all_reduce": 3}
        expected["world"] = {"all_reduce": 1}
    else:
        expected["data_parallel"]["all_reduce"] = 1
    assert c["by_group"] == expected
    assert r["modeled"]["by_group"] == expected  # benchmarks.collectives derives the same
    assert "all_reduce" not in c["backward"]
    assert c["grad_sync_and_clip"] == {"all_reduce": 2 if tp > 1 else 1}
    assert c["optimizer"] == {}


@pytest.mark.slow
def test_state_bytes_halve(tp2_audit):
    r = tp2_audit
    one, two = r["modeled"]["state_bytes_tp1"], r["measured"]["state_bytes"]
    # tiny: 3,327,744 params; whole at TP=2: wpe 128x64, LayerNorms 5x2x64, row-parallel biases 4x64
    n, replicated = 3_327_744, 128 * 64 + 10 * 64 + 4 * 64
    assert one == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "total": 16 * n}
    expected = (n - replicated) // 2 + replicated
    assert two == {"params": 4 * expected, "grads": 4 * expected, "optimizer": 8 * expected, "total": 16 * expected}


@pytest.mark.slow
def test_mistakes_are_one_error_line(command_here):
    """A bad flag, as a real process; no torchrun, as the command's __main__ runs it in this process (conftest's
    command_here), outside any process group."""
    from benchmarks.audit import main

    proc = subprocess.run([sys.executable, "-m", "benchmarks.audit", "--model", "tiny", "--nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert "unrecognized arguments: --nope" in one_error_line(proc)
    assert "run this command under torchrun" in one_error_line(command_here(lambda: main(["--model", "tiny"])))


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2)], ids=["tp2", "dp2xtp2"])
@pytest.mark.slow
def test_muon_collectives_and_state(shared_audit, dp, tp):
    """--optimizer muon: the optimizer step communicates what benchmarks.collectives.muon_collectives says (the audit
    exits 0 only then, on every rank), by hand for L = 2 blocks, C = 64 (12 C^2 elements a block, 24 C^2 in all, bf16):
    every matrix owner-computed, two all-to-alls over the whole mesh and nothing else; rank 0 owns 12 C^2 elements at
    TP=2 and sends its half of the others' matrices, then half of its own matrices' updates: 12 C^2 x 2 bytes, the
    bytes of all-gathering every matrix once; at DP=2 x TP=2 it owns 7 C^2, sends (24 - 7) / 4 C^2 and 7 x 3 / 4 C^2,
    0.53 of that. One momentum buffer per block matrix (12 C^2 elements a block), two AdamW moments for every other
    parameter."""
    r = shared_audit(dp * tp, "--dp", str(dp), "--optimizer", "muon", "--batch-size", "2")
    L, C = 2, 64
    assert r["measured"]["collectives"]["optimizer"] == {"all_to_all": 2}
    sent = sum(row["wire_bytes"] for row in r["measured"]["collective_rows"] if row["kind"] == "all_to_all")
    assert sent == (12 * C * C * 2 if dp == 1 else (17 + 21) * C * C // 4 * 2)
    assert sent <= collectives.muon_gather_all_bytes(GPTConfig.from_name("tiny"), dp, tp) == 2 * L * 12 * C * C * (dp * tp - 1) // (dp * tp)
    if dp == 1:
        rows = [row for row in r["measured"]["collective_rows"] if row["kind"] == "all_reduce"]
        adamw_all_reduces = 4 * (128 * 64 + (2 * L + 1) * 2 * 64) + 2 * 64 * 12 + 4  # as in the AdamW test, B = 2
        assert sum(row["bytes"] for row in rows) == adamw_all_reduces
    n, matrices = 3_327_744, L * 12 * C * C
    assert r["modeled"]["state_bytes_tp1"]["optimizer"] == 4 * (2 * n - matrices)
