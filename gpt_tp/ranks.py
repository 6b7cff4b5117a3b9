"""The DP x TP layout, its one mesh builder, where this process sits in it, and what the model it trains is."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("data_parallel", "tensor_parallel")  # the one DeviceMesh's dims, outer (across nodes) to inner


@dataclass(frozen=True)
class Layout:
    """A run's data-parallel x tensor-parallel layout (gpt_tp.sizing.check_run validates it against the model, once)
    and, once a mesh exists, this process's place in it: build_mesh makes the mesh, layout_of reads it back."""

    dp: int  # data-parallel size: FSDP2 replicas under ModelParallelStrategy, every process under DDP
    tp: int  # tensor-parallel size
    dp_rank: int = 0  # this process among the dp replicas (TP ranks share one)
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)  # None: no mesh (one process, or DDP)

    world = property(lambda self: self.dp * self.tp)
    dp_group = property(lambda self: None if self.mesh is None else self.mesh[MESH_DIMS[0]].get_group())  # None: default

    def __str__(self) -> str:
        return f"DP={self.dp} x TP={self.tp}"


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """`layout`'s DeviceMesh on the default group: every path's (gpt_tp's ModelParallel, torchrun_mesh, --simulate)."""
    return init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=MESH_DIMS)


def layout_of(trainer=None, pl_module=None, mesh: DeviceMesh | None = None) -> Layout:
    """This process's Layout: from `mesh`, else the module's (or the trainer's module's) mesh; else every process is a
    data-parallel replica (DDP-like strategies: their sampler's rank and size); else one process."""
    module = pl_module if pl_module is not None else getattr(trainer, "lightning_module", None)
    mesh = mesh if mesh is not None else getattr(module, "device_mesh", None)
    if mesh is not None:
        dp = mesh[MESH_DIMS[0]]
        return Layout(dp.size(), mesh[MESH_DIMS[1]].size(), dp.get_local_rank(), mesh)
    kwargs = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None) or {}
    return Layout(kwargs.get("num_replicas", 1), 1, kwargs.get("rank", 0))


def model_config(model):
    """The GPTConfig of a GPT, of a GPTModule (its .model) or of anything with a .config; None without one."""
    return getattr(getattr(model, "model", model), "config", None) or getattr(model, "config", None)


def model_vocab(model) -> int | None:
    """Token ids the model takes: its config's vocab_used (below a padded vocabulary) or vocab_size, else None."""
    config = model_config(model)
    return getattr(config, "vocab_used", None) or getattr(config, "vocab_size", None)
