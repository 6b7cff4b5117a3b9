"""The one place gpt_tp uses torch internals (no public API does their job), checked on the versions in CHECKED by
tests/test_torch_internals.py: sequence parallelism's functional collectives (traced by torch.compile, matched by
Inductor's async-TP pass), async TP's switches, --simulate's fake tensors, dispatch mode and memory trackers."""

import warnings

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


def enable_micro_pipeline_tp(group_name: str) -> None:
    """Inductor's micro-pipelining of TP collectives with their matmuls over symmetric memory (as torchtitan does)."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # deprecated in recent torch, but the Inductor pass still checks for it
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(group_name)
