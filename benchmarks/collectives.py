"""Collectives measured as a step runs: every collective issued inside a CollectiveRecorder, with its process group
and the bytes of its full tensor, summed into the rows gpt_tp.sizing.sizes.step_collectives models."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpt_tp.sizing import sizes

# collectives by the op's name (functional and c10d in-place ops alike) -> kind
KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective issued inside it as (mesh dim, kind, bytes): functional collectives (what DTensor
    emits) and c10d ops (torch.distributed.all_reduce, FSDP2's all-gathers and reduce-scatters).

    bytes is the size of the full tensor a collective produces or consumes (all-gather: its output, reduce-scatter:
    its input, all-reduce: the buffer); `groups` maps process-group names to (label, size), e.g. from
    groups_of(mesh). Like CommDebugMode, DTensor ops are let through so their collectives are seen once desugared.
    """

    def __init__(self, groups: dict[str, tuple[str, int]]):
        super().__init__()
        self.groups = groups
        self.records: list[tuple[str, str, int, int]] = []  # (label, kind, group_size, nbytes)

    def _group(self, args) -> tuple[str, int]:
        for a in args:
            if isinstance(a, str) and a in self.groups:
                return self.groups[a]
            if isinstance(a, torch.ScriptObject):  # c10d ops carry the ProcessGroup boxed
                try:
                    pg = torch.distributed.ProcessGroup.unbox(a)
                except Exception:  # noqa: BLE001 - a boxed ReduceOp or Work, not the group
                    continue
                return self.groups.get(pg.group_name, (pg.group_name, pg.size()))
        return ("?", 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        ns, _, name = func.name().partition("::")
        name = name.split(".")[0]
        if ns in _NAMESPACES and name in KINDS:
            kind = KINDS[name]
            label, size = self._group(args)
            if kind == "all_gather":
                if ns == "c10d":  # (output(s), input(s), pg, ...)
                    nbytes = _nbytes(args[0])
                else:  # (input(s), group_size, group_name)
                    nbytes = _nbytes(args[0]) * args[1]
            elif kind == "reduce_scatter" and ns == "c10d":
                nbytes = _nbytes(args[1])
            else:
                nbytes = _nbytes(args[0])
            self.records.append((label, kind, size, nbytes))
        return out

    def summary(self) -> list[dict]:
        """Per (mesh dim, kind): count, bytes (full tensors) and wire_bytes (sent per rank, ring algorithm), in the
        rows of gpt_tp.sizing.sizes.step_collectives."""
        return sizes.merge([sizes.collective(label, kind, size, 1, nbytes) for label, kind, size, nbytes in self.records])


def groups_of(mesh) -> dict[str, tuple[str, int]]:
    """Process-group name -> (mesh dim name, size) for every dim of a DeviceMesh, and the whole job as "world"
    (where gpt_tp.parallel.clip_grad_norm all-reduces the norm on a 2-D mesh)."""
    out = {torch.distributed.group.WORLD.group_name: ("world", torch.distributed.get_world_size())}
    for dim in mesh.mesh_dim_names:
        g = mesh[dim].get_group()
        out[g.group_name] = (dim, g.size())
    return out
