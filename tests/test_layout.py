"""Layout and batch validation: errors that say what to change, before any work starts."""

import pytest

from gpt_tp.model import GPTConfig
from gpt_tp.sizing import LayoutError, check_total_batch, fitting_layouts, valid_tp_sizes, validate_layout


def test_messages_name_no_flag():
    """The layout check speaks of the model; each command names its own flags (cli.py: trainer.strategy...)."""
    for kwargs in ({"tp": 8}, {"tp": 2, "world_size": 4}, {"tp": 2, "seq_len": 1023}, {"tp": 0}):
        with pytest.raises(LayoutError) as e:
            validate_layout(GPTConfig.from_name("gpt2"), **kwargs)
        msg = str(e.value)
        assert not any(flag in msg for flag in ("parallel_size", "trainer.", "model.", "data.", "--")), msg


def test_twelve_heads_on_eight_gpus():
    with pytest.raises(LayoutError) as e:
        validate_layout(GPTConfig.from_name("gpt2"), tp=8, dp=1, world_size=8)
    msg = str(e.value)
    assert e.value.quantities == ("tp", "n_head")
    assert "tensor-parallel size 8 must divide n_head=12 (every rank holds whole attention heads)" in msg
    assert "1, 2, 3, 4, 6, 12" in msg
    assert "Layouts that fit 8 devices: DP=8 x TP=1, DP=4 x TP=2, DP=2 x TP=4." in msg


def test_valid_sizes_per_model():
    assert valid_tp_sizes(GPTConfig.from_name("gpt2")) == [1, 2, 3, 4, 6, 12]
    assert valid_tp_sizes(GPTConfig.from_name("gpt2-xl")) == [1]  # 25 heads and vocab 50304 = 2^7 x 3 x 131
    assert valid_tp_sizes(GPTConfig.from_name("gpt2-xl", n_head=32, n_embd=1600)) == [1, 2, 4, 8, 16, 32]
    assert fitting_layouts(GPTConfig.from_name("gpt2"), 8) == [(8, 1), (4, 2), (2, 4)]
    assert valid_tp_sizes(GPTConfig.from_name("gpt2"), seq_len=1022) == [1, 2]


def test_world_size_mismatch():
    with pytest.raises(LayoutError, match=r"data-parallel size 1 x tensor-parallel size 2 = 2, but the run has 4 devices.*DP=4 x TP=1, DP=2 x TP=2, DP=1 x TP=4") as e:
        validate_layout(GPTConfig.from_name("gpt2"), tp=2, dp=1, world_size=4)
    assert e.value.quantities == ("dp", "tp", "world_size")


def test_unpadded_vocab_and_sequence_length():
    with pytest.raises(LayoutError, match="tensor-parallel size 2 must divide vocab_size=50257.*pad it"):
        validate_layout(GPTConfig.from_name("gpt2", vocab_size=50257), tp=2)
    with pytest.raises(LayoutError, match=r"tensor-parallel size 2 must divide seq_len=1023 \(sequence parallelism") as e:
        validate_layout(GPTConfig.from_name("gpt2"), tp=2, seq_len=1023)
    assert e.value.quantities == ("tp", "seq_len")
    validate_layout(GPTConfig.from_name("gpt2"), tp=4, dp=2, world_size=8, seq_len=1024)  # fine


def test_total_batch_size_check_names_the_fix():
    check_total_batch(524288, 16, 1024, 1, 32)
    check_total_batch(None, 3, 5, 1, 1)
    with pytest.raises(ValueError, match="set trainer.accumulate_grad_batches=32"):
        check_total_batch(524288, 16, 1024, 1, 1)
    with pytest.raises(ValueError, match="choose data.batch_size and data.seq_len"):
        check_total_batch(524288, 12, 1000, 1, 1)
