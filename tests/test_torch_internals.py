"""The torch internals gpt_tp.torch_internals relies on still work as it expects: a torch upgrade that changes one fails
here, by name, before it breaks sequence parallelism or --simulate."""

import inspect
import platform
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpt_tp.torch_internals import CHECKED, FUNCTIONAL, FakeTensorMode, memory_tracker


@contextmanager
def process_group(backend: str, rank: int = 0, world_size: int = 1):
    """A process group in this process (gloo over a HashStore, or the fake one with its own store), destroyed after."""
    dist.init_process_group(backend, store=dist.HashStore() if backend == "gloo" else None, rank=rank,
                            world_size=world_size)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def test_checked_against_this_torch():
    assert torch.__version__.startswith(CHECKED), (
        f"torch {torch.__version__} is not among {CHECKED}: check gpt_tp/torch_internals.py against it")


def test_functional_collectives_take_a_group_name():
    """gpt_tp.parallel.sp calls the functional collectives positionally, the group by its name: their signatures, and
    their numbers on a one-rank gloo group (the many-rank numbers: tests/test_tp_parity.py)."""
    assert [str(getattr(FUNCTIONAL, op).default._schema) for op in ("all_gather_into_tensor", "reduce_scatter_tensor",
                                                                    "wait_tensor")] == [
        "_c10d_functional::all_gather_into_tensor(Tensor input, int group_size, Any group_name) -> Tensor",
        "_c10d_functional::reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, Any group_name) -> Tensor",
        "_c10d_functional::wait_tensor(Tensor tensor) -> Tensor"]
    x = torch.arange(6.0).reshape(2, 3)
    with process_group("gloo") as group:
        gathered = FUNCTIONAL.wait_tensor(FUNCTIONAL.all_gather_into_tensor(x, 1, group))
        scattered = FUNCTIONAL.wait_tensor(FUNCTIONAL.reduce_scatter_tensor(x, "sum", 1, group))
    assert torch.equal(gathered, x) and torch.equal(scattered, x)


def test_micro_pipeline_pass_matches_mm_and_splits_addmm_on_gpus_only():
    """docs/performance.md's reason for no async TP setting: Inductor's micro-pipeline pass fuses an all-gather into an
    aten.mm (or _scaled_mm), never an addmm; addmm becomes mm + add on a GPU only, before pointwise users."""
    from torch._inductor.fx_passes import micro_pipeline_tp, post_grad

    source = inspect.getsource(micro_pipeline_tp)
    assert "aten.mm.default, aten._scaled_mm.default" in source and "addmm" not in source
    assert "if not is_gpu(inp.meta[\"val\"].device.type):" in inspect.getsource(post_grad.should_prefer_unfused_addmm)


def test_fake_tensors_allocate_nothing():
    """--simulate builds the model and steps on fake tensors: shapes and dtypes without storage, real inputs allowed."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        huge = torch.ones(1 << 40, dtype=torch.bfloat16)  # 2 TiB, were it real
        y = huge[:3] + torch.ones(3)
    assert y.shape == (3,) and y.dtype == torch.float32 and huge.nbytes == 1 << 41


def test_the_fake_process_group_and_collective_counts():
    """The public fake process group (its own store) at rank 3 of 8; --simulate's TorchDispatchMode counts the functional
    collectives (by their group name) and c10d's (their group boxed) that run under it."""
    from gpt_tp.cli.simulate import CollectiveCounts

    with process_group("fake", rank=3, world_size=8) as group:
        assert (dist.get_rank(), dist.get_world_size()) == (3, 8)
        with CollectiveCounts({group: "world"}) as comms:
            FUNCTIONAL.wait_tensor(FUNCTIONAL.all_gather_into_tensor(torch.ones(2), 8, group))
            FUNCTIONAL.wait_tensor(FUNCTIONAL.reduce_scatter_tensor(torch.ones(8), "sum", 8, group))
            dist.all_reduce(torch.ones(2))
            dist.all_reduce(torch.ones(2))
    assert dict(comms.counts) == {("world", "all_gather"): 1, ("world", "reduce_scatter"): 1, ("world", "all_reduce"): 2}


def test_memory_tracker_reports_by_the_kinds_simulate_reads():
    """memory_tracker's peak snapshot: {device: {kind: bytes}}, a Linear's weights and gradients to the byte; every kind
    --simulate sums (TRACKER_KINDS) is one of MemTracker's or FSDPMemTracker's."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed._tools.mem_tracker import _MemRefType

    from gpt_tp.cli.simulate import TRACKER_KINDS

    known = {t.name for t in _MemRefType} | {t.name for t in _FSDPRefType}
    assert {k for keys in TRACKER_KINDS.values() for k in keys} <= known
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = memory_tracker(model, optimizer, fsdp=False)
    with tracker:
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
    (device, peak), = tracker.get_tracker_snapshot("peak").items()
    by_kind = {str(k).split(".")[-1]: v for k, v in peak.items()}
    assert str(device) == "cpu" and by_kind["PARAM"] == by_kind["GRAD"] == (64 * 32 + 32) * 4
    assert by_kind["OPT"] >= 2 * (64 * 32 + 32) * 4  # AdamW's two moments


def test_shard_slices_tile_the_tensor_by_dtensors_own_arithmetic():
    """Owner-computes Muon sends each rank's block of a matrix by shard_slices: on a 2x2 mesh (rank 3 of 4, the fake
    group), uneven chunks and FSDP-over-TP (Shard(0), Shard(1)); the blocks of all ranks tile the tensor once, this
    rank's block is its local tensor's shape, and a dispatch mode in force (--simulate's) does not see the arithmetic."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gpt_tp.torch_internals import TorchDispatchMode, shard_slices

    class Refuse(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"{func} ran under the dispatch mode")

    with process_group("fake", rank=3, world_size=4):
        mesh = init_device_mesh("cpu", (2, 2))
        for placements in ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)]):
            p = distribute_tensor(torch.zeros(7, 5), mesh, placements)
            with Refuse():
                blocks = [shard_slices(p, r) for r in range(4)]
            count = torch.zeros(7, 5)
            for rows, cols in blocks:
                count[rows, cols] += 1
            assert count.eq(1).all(), (placements, blocks)
            assert tuple(s.stop - s.start for s in blocks[3]) == tuple(p.to_local().shape), (placements, blocks)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or platform.machine() != "x86_64", reason="reads x86 flags")
def test_native_bf16_matmul_is_what_the_cpu_flags_say():
    """cpu_bf16_matmul_is_native (ShardedMuon's choice of Newton-Schulz's matmul dtype on CPU) is true exactly where
    the kernel lists AMX's bf16 tiles or AVX512-BF16 for this CPU."""
    from gpt_tp.torch_internals import cpu_bf16_matmul_is_native

    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
    assert cpu_bf16_matmul_is_native() is bool(flags & {"amx_bf16", "avx512_bf16"})
