"""Communication audit and memory at TP=2 (gloo, 2 processes), against numbers derived by hand.

The Megatron sequence-parallel minimum for L blocks (derivation in gpt_tp/audit.py):
  all_gather 4L + 2   (per block: before attention and MLP in forward, for the reduce-scatters' grads in backward;
                       + lm_head's sequence gather in forward, + the embedding's grad in backward)
  reduce_scatter 4L + 2 (mirror image: after attention and MLP; + the embedding in forward, + lm_head in backward)
  all_reduce 4        (2 in vocab-parallel cross-entropy: the max, then the sum of exps with the target logit;
                       1 coalesced for replicated-parameter grads, 1 grad norm)
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
