"""The one place gpt_tp touches torch internals (no public API does the job), checked on the versions in CHECKED, which
tests/test_torch_internals.py guards: the functional collectives sequence parallelism runs (traceable by torch.compile,
the ops Inductor's async-TP pass matches), async TP's switches, and --simulate's fake tensors, dispatch mode and
memory trackers. (--simulate's fake process group is public: dist.init_process_group("fake") makes its own store.)"""

import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

CHECKED = ("2.13",)  # torch.__version__ prefixes this module was checked against
# all_gather_into_tensor(x, n, group_name), reduce_scatter_tensor(x, "sum", n, group_name), wait_tensor(x)
FUNCTIONAL = torch.ops._c10d_functional


def memory_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """A tracker of the memory `model` and `optimizer` hold, by kind: FSDPMemTracker for an FSDP2 model, else MemTracker
    (imported here: a second or two that only --simulate spends)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp:
        return FSDPMemTracker(model, optimizer)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def enable_micro_pipeline_tp(group_name: str) -> None:
    """Inductor's micro-pipelining of TP collectives with their matmuls over symmetric memory, for `group_name`
    (torchtitan does the same)."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # deprecated in recent torch, but the Inductor pass still checks for it
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(group_name)
