"""Text samples: build-nanogpt's top-k loop, reproducible for a seed, identical on every TP rank."""

import pytest
import torch

from conftest import read_json, run_torchrun
from gpt_tp.errors import DataError
from gpt_tp.infer.sampling import PROMPT, TextSampleCallback, generate, last_logits, sample_texts


def test_same_seed_same_text_and_prompt_kept(tiny, enc):
    kw = dict(num_samples=3, max_length=16, block_size=128)
    a = sample_texts(tiny, enc, seed=5, **kw)
    assert a == sample_texts(tiny, enc, seed=5, **kw)
    assert a != sample_texts(tiny, enc, seed=6, **kw)
    assert len(a) == 3 and all(t.startswith(PROMPT) for t in a)
    assert len(set(a)) == 3  # the rows draw from one stream: different continuations
    ids = generate(tiny, enc.encode(PROMPT), seed=5, vocab_limit=enc.n_vocab, **kw)
    assert ids.shape == (3, 16) and enc.decode(ids[0].tolist()) == a[0]


def test_tp_padding_leaves_samples_unchanged(tiny, enc):
    """Right-padding to a multiple of the TP degree (4 here) does not change the causal model's last logits."""
    kw = dict(num_samples=2, max_length=15, block_size=128, seed=11)
    assert sample_texts(tiny, enc, tp=4, **kw) == sample_texts(tiny, enc, tp=1, **kw)


def test_top_k_and_padded_vocab(enc):
    """Only the top_k ids are drawn, and never an id >= vocab_limit (the padded rows) even when it scores highest."""
    V = 64

    def model(idx):  # logits rising with the id: ids 60-63 would win, but they are padding
        return torch.arange(V, dtype=torch.float).expand(idx.shape[0], idx.shape[1], V)

    ids = generate(model, [1, 2], num_samples=8, max_length=40, top_k=3, seed=0, block_size=16, vocab_limit=60)
    new = ids[:, 2:]
    assert set(new.unique().tolist()) <= {57, 58, 59}
    assert len(set(new.unique().tolist())) > 1  # sampled, not argmax


def test_window_longer_than_block_size(tiny, enc):
    ids = generate(tiny, enc.encode(PROMPT), num_samples=1, max_length=24, block_size=16, tp=2, seed=0, vocab_limit=enc.n_vocab)
    assert ids.shape == (1, 24)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_length=3 must exceed"):
        generate(lambda x: x, [1, 2, 3], max_length=3)
    with pytest.raises(ValueError, match="non-empty prompt"):
        generate(lambda x: x, [], max_length=3)
    with pytest.raises(ValueError, match="every_n_steps=-2"):
        TextSampleCallback(every_n_steps=-2)


def test_prompt_ids_checked_against_the_vocabulary():
    """A prompt id the model has no row for (or one the sampler would never draw) is named before any forward."""
    with pytest.raises(DataError, match=r"^the sampling prompt: token id 75 at position 2 is outside the model's vocabulary \(0..59\)"):
        generate(lambda x: 1 / 0, [1, 2, 75], max_length=8, vocab_limit=60)


def test_last_logits_plain():
    x = torch.randn(2, 5, 7)
    assert torch.equal(last_logits(x, 3), x[:, 3])


@pytest.mark.slow
def test_tp2_samples_identical_on_both_ranks_and_single_device(tmp_path):
    """TP=2 on two gloo processes: the vocab-sharded model samples, from the same seed, exactly the single-device
    text, on both ranks. (The Lightning callback is checked the same way in
    tests/test_hellaswag.py::test_callbacks_in_tp2_fit_match_single_device.)"""
    run_torchrun("hellaswag_dist.py", 2, "--sample-only", "--out", str(tmp_path / "s"))
    r0, r1 = (read_json(tmp_path / f"s.{rank}.json") for rank in range(2))
    assert r0["samples"] == r1["samples"] == r0["ref_samples"]
    assert len(r0["samples"]) == 3 and all(s.startswith(PROMPT) for s in r0["samples"])
