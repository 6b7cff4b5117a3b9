"""Where this process sits in a Lightning trainer's layout."""


def data_parallel_rank_size(trainer) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel replicas: the DP dim of ModelParallelStrategy's mesh,
    all processes for DDP-like strategies, (0, 1) without a trainer or on one device."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
    kwargs = kwargs or {}
    return kwargs.get("rank", 0), kwargs.get("num_replicas", 1)
