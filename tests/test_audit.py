"""Communication audit and memory at TP=2, DP=2 x TP=2 and DP=2 x TP=1 (gloo), against numbers derived by hand.

The Megatron sequence-parallel minimum for L blocks on the TP group (derivation in gpt_tp/perf/audit.py):
  all_gather 4L + 2   (per block: before attention and MLP in forward, for the reduce-scatters' grads in backward;
                       + lm_head's sequence gather in forward, + the embedding's grad in backward)
  reduce_scatter 4L + 2 (mirror image: after attention and MLP; + the embedding in forward, + lm_head in backward)
  all_reduce 3        (2 in vocab-parallel cross-entropy: the max, then the sum of exps with the target logit;
                       1 flat one for the replicated-parameter grads)
FSDP2 on the DP group (L block units + the root): all_gather 2L + 1 (each unit before forward, each block again
before backward), reduce_scatter L + 1. The grad norm: 1 all_reduce over the whole mesh.
"""

import pytest

from conftest import read_json, run_torchrun


@pytest.mark.parametrize("n_layer", [2, 3])
def test_collectives_equal_megatron_minimum(tmp_path, n_layer):
    out = tmp_path / "r.json"
    run_torchrun("../../scripts/tp_report.py", 2, "--model", "tiny", "--seq-len", "64", "--layers", str(n_layer), "--json", str(out))
    r = read_json(out)
    L = n_layer
    assert r["megatron_minimum"] == {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L + 2, "all_reduce": 4}
    assert r["collectives"]["total"] == r["megatron_minimum"]
    c = r["collectives"]
    assert c["forward"] == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": 2}
    assert c["backward"] == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1}
    assert c["grad_sync_and_clip"] == {"all_reduce": 2}
    assert c["optimizer"] == {}  # no hidden per-parameter reductions inside the fused AdamW step


@pytest.mark.parametrize("dp,tp,n_layer", [(2, 2, 3), (2, 1, 2)], ids=["dp2xtp2", "dp2xtp1"])
def test_dp_collectives_equal_minimum(tmp_path, dp, tp, n_layer):
    """No per-parameter all-reduce inside FSDP2's backward, one flat all-reduce of the replicated gradients over TP,
    one grad-norm all-reduce over the whole mesh."""
    out = tmp_path / "r.json"
    run_torchrun("audit_mesh.py", dp * tp, "--dp", str(dp), "--layers", str(n_layer), "--out", str(out))
    r = read_json(out)
    L, c = n_layer, r["collectives"]
    expected = {"data_parallel": {"all_gather": 2 * L + 1, "reduce_scatter": L + 1}}
    if tp > 1:
        expected["tensor_parallel"] = {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L + 2, "all_reduce": 3}
        expected["world"] = {"all_reduce": 1}
    else:
        expected["data_parallel"]["all_reduce"] = 1
    assert c["by_group"] == expected
    assert r["minimum"] == expected  # gpt_tp.perf.audit derives the same
    assert "all_reduce" not in c["backward"]
    assert c["grad_sync_and_clip"] == {"all_reduce": 2 if tp > 1 else 1}
    assert c["optimizer"] == {}


def test_state_bytes_halve(tmp_path):
    out = tmp_path / "r.json"
    run_torchrun("../../scripts/tp_report.py", 2, "--model", "tiny", "--seq-len", "64", "--json", str(out))
    r = read_json(out)
    one, two = r["bytes_tp1"], r["bytes_tp2_per_rank"]
    # tiny: 3,327,744 params; replicated at TP=2: wpe 128x64, LayerNorms 5x2x64, row-parallel biases 4x64
    n, replicated = 3_327_744, 128 * 64 + 10 * 64 + 4 * 64
    assert one == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "total": 16 * n}
    expected = (n - replicated) // 2 + replicated
    assert two == {"params": 4 * expected, "grads": 4 * expected, "optimizer": 8 * expected, "total": 16 * expected}
