"""Meta-device init on real gloo processes: every rank cuts its shards from rank 0's init."""

import pytest
from conftest import read_json, run_torchrun


@pytest.mark.slow
def test_meta_init_ranks_with_different_random_states_get_one_init(tmp_path):
    """Ranks seeded differently before building on the meta device: after materialize the gathered TP=2 model is
    exactly the eager single-device build from rank 0's random state (without the seed broadcast, the sharded
    weights mix two inits)."""
    out = tmp_path / "seed"
    run_torchrun("meta_init_seed.py", 2, "--out", str(out))
    r = read_json(f"{out}.json")
    assert r["world"] == 2 and r["compared"] == 28
    assert r["mismatched"] == []
