"""The one place gpt_tp uses torch internals (no public API does their job), checked on the versions in CHECKED by
tests/test_torch_internals.py: sequence parallelism's functional collectives (traced by torch.compile), --simulate's
fake tensors, dispatch mode and memory trackers, the CPU's bf16 matmul hardware."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

CHECKED = ("2.13",)  # torch.__version__ prefixes this module was checked against
FUNCTIONAL = torch.ops._c10d_functional  # all_gather_into_tensor, reduce_scatter_tensor, wait_tensor; groups by name


def memory_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """FSDPMemTracker of an FSDP2 model and its optimizer, else MemTracker (imported here, for --simulate only)."""
    from torch.distributed._tools import FSDPMemTracker, MemTracker

    if fsdp:
        return FSDPMemTracker(model, optimizer)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def shard_slices(p, rank: int) -> tuple[slice, ...]:
    """The block of DTensor p that `rank` holds, one slice per dim, by DTensor's own arithmetic (Shard, FSDP2's
    _StridedShard, uneven chunks), outside any dispatch mode (--simulate's fake tensors)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        coordinate = (p.device_mesh.mesh == rank).nonzero()[0].tolist()
        shape, offset = _compute_local_shape_and_global_offset(p.shape, p.device_mesh.shape, coordinate, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def cpu_bf16_matmul_is_native() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles or AVX512-BF16): there a bf16 matmul is faster
    than a float32 one; elsewhere torch emulates it, many times slower (docs/performance.md, "Muon")."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
