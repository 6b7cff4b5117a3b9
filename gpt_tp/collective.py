"""One rank acts for all, and every rank learns how it went: ``one_does(fn, doer)`` runs ``fn`` on the doer ranks
(default: global rank 0), then one all-gather shares the outcome, and every rank raises a doer's error, so no rank
walks on into a collective its failed peer will never join. Without a process group ``fn`` just runs."""

import pickle
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def _portable(e: Exception | None) -> Exception | None:
    """``e`` if it survives pickling (what the all-gather does), else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception class whose __init__ does not take its args back
        return RuntimeError(f"{type(e).__name__}: {e}")


def one_does(fn: Callable[[], T], doer: bool | None = None) -> T | None:
    """``fn``'s result on the doers, None elsewhere (or a doer's error everywhere); call it on every rank of the job."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    doer = dist.get_rank() == 0 if doer is None else doer
    result, error = None, None
    if doer:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - shared with every rank below, then raised here too
            error = e
    outcomes: list[Exception | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, _portable(error))
    failed = [r for r, e in enumerate(outcomes) if e is not None]
    if failed:  # the lowest failing rank's error on every rank: one line for the run, however many failed
        raise error if failed[0] == dist.get_rank() else outcomes[failed[0]]
    return result
