"""Layout and batch validation: errors that say what to change, before any work starts."""

import dataclasses
from types import SimpleNamespace
from unittest import mock

import pytest

from conftest import read_json, run_torchrun
from gpt_tp.model import GPTConfig
from gpt_tp.ranks import MESH_DIMS, Layout, build_mesh, layout_of
from gpt_tp.sizing import LayoutError, check_total_batch, fitting_layouts, valid_tp_sizes, validate_layout
from gpt_tp.train.run import resolve_run


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


def test_one_frozen_layout_object():
    """One object for DP x TP: its sizes, its world, its printed name; frozen; a run holds the one resolve_run made."""
    layout = Layout(2, 4)
    assert (layout.world, str(layout), layout.dp_rank, layout.dp_group) == (8, "DP=2 x TP=4", 0, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 2
    run = resolve_run(GPTConfig.from_name("gpt2"), 2, 4, seq_len=1024, world_size=8)
    assert (run.layout, run.dp, run.tp, run.world) == (Layout(2, 4), 2, 4, 8)
    with pytest.raises(LayoutError, match="data-parallel size 1 x tensor-parallel size 4 = 4, but the run has 8 devices"):
        resolve_run(GPTConfig.from_name("gpt2"), 1, 4, world_size=8)  # validated once, by check_run's words


def test_layout_of_a_trainer_without_a_mesh():
    """No mesh: every process of a DDP-like strategy is a DP replica (its sampler's rank and size); else one process."""
    ddp = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 3}))
    assert layout_of(ddp) == Layout(4, 1, 3)
    assert layout_of(SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=None))) == Layout(1, 1, 0)
    assert layout_of() == Layout(1, 1, 0) and layout_of().dp_group is None


def test_simulate_builds_its_mesh_with_build_mesh():
    """--simulate's fake world gets its mesh from build_mesh: rank 3 of DP=2 x TP=2 sits where a real run's does."""
    from gpt_tp.cli import simulate

    seen = []

    def build(layout, device_type):
        mesh = build_mesh(layout, device_type)
        seen.append((layout, mesh.mesh.tolist(), mesh.mesh_dim_names, layout_of(mesh=mesh)))
        return mesh

    run = resolve_run(GPTConfig.from_name("tiny"), 2, 2, seq_len=32, batch_size=2, world_size=4)
    with mock.patch.object(simulate, "build_mesh", side_effect=build):
        simulate.simulate(run, rank=3)
    assert seen == [(Layout(2, 2), [[0, 1], [2, 3]], MESH_DIMS, Layout(2, 2, 1))]


def test_one_mesh_builder_on_real_processes(tmp_path):
    """4 gloo processes as DP=2 x TP=2: torchrun_mesh's mesh and Lightning's (ModelParallel's setup_environment) are
    build_mesh's, and layout_of reads the same sizes, ranks and groups from each, as Lightning's sampler does."""
    run_torchrun("layout_mesh.py", 4, "--out", str(tmp_path / "mesh"))
    for rank in range(4):
        res = read_json(tmp_path / f"mesh.{rank}.json")
        dp_group, tp_group = [rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]
        expected = {"layout": [2, 2, rank // 2], "mesh": [[0, 1], [2, 3]], "dp_group": dp_group,
                    "groups": {"data_parallel": dp_group, "tensor_parallel": tp_group}}
        assert res["torchrun"] == res["lightning"] == expected
        assert res["lightning_built"] == ["DP=2 x TP=2"]
        assert res["sampler"] == {"num_replicas": 2, "rank": rank // 2}
