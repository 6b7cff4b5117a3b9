"""Where this process sits in a Lightning trainer's layout, and what the model it trains is."""


def data_parallel_rank_size(trainer) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel replicas: the DP dim of ModelParallelStrategy's mesh,
    all processes for DDP-like strategies, (0, 1) without a trainer or on one device."""
    kwargs = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None) or {}
    return kwargs.get("rank", 0), kwargs.get("num_replicas", 1)


def parallel_layout(trainer, pl_module) -> tuple[int, int, int, object]:
    """(tp, dp_rank, dp_size, dp_group) of this process: ModelParallelStrategy's mesh, else every process is a
    data-parallel replica (DDP-like strategies; dp_group None: the default group), else one process."""
    mesh = getattr(pl_module, "device_mesh", None)
    if mesh is not None:
        dp_mesh = mesh["data_parallel"]
        return mesh["tensor_parallel"].size(), dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group()
    return 1, *data_parallel_rank_size(trainer), None


def model_config(model):
    """The GPTConfig of a GPT, of a GPTModule (its .model) or of anything with a .config; None without one."""
    return getattr(getattr(model, "model", model), "config", None) or getattr(model, "config", None)


def model_vocab(model) -> int | None:
    """Token ids the model takes: its config's vocab_used (below a padded vocabulary) or vocab_size, else None."""
    config = model_config(model)
    return getattr(config, "vocab_used", None) or getattr(config, "vocab_size", None)


def block_size_of(model) -> int:
    """The model's block_size (longest sequence it takes); ValueError without a config."""
    config = model_config(model)
    if config is None:
        raise ValueError("the model's block_size is needed: give it a config (model.config or model.model.config)")
    return config.block_size
