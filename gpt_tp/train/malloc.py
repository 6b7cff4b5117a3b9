"""Where a CPU training process's buffers live: glibc malloc's heap or mappings of their own (model.malloc).

glibc serves a buffer from its heap, or, from M_MMAP_THRESHOLD bytes up and when no freed heap chunk fits it,
from a mapping of its own that is unmapped when freed. By default the threshold starts at 128 KiB and rises, up
to 32 MiB, each time such a buffer is freed, so activation-sized tensors soon come from the heap. The heap then
interleaves buffers that live the whole run (weights, gradients, optimizer state) with buffers one step frees;
it can only shrink from its top, and a process's resident memory grows to the high-water mark of that
fragmented heap.

    "split"  (default) everything allocated until the first optimizer step has returned (in a validate or
             predict run, until it starts), weights, gradients and optimizer state, gets mappings of its own
             (threshold fixed at 128 KiB); from then on the threshold is fixed at 64 MiB, so the per-step
             buffers reuse a heap that holds nothing else, and gradients under 64 MiB are zeroed in place (not
             freed), so they stay where they are. Before each step's loss, its high point (the logits and
             their exponentials are mapped then), the heap's free pages go back to the system (malloc_trim),
             so the freed step buffers between those still in use are not resident then; backward touches
             again the ones it reuses.
    "mmap"   every buffer from 128 KiB up gets its own mapping, for the whole run: the lowest peak RSS, and
             slower steps, since each step's buffers are page-faulted afresh.
    "glibc"  glibc's defaults.

Only processes on a machine without CUDA change anything (GPU memory has its own allocator).
"""

import ctypes
import functools

import torch
from torch.distributed.tensor import DTensor

from gpt_tp.errors import UserError

POLICIES = ("split", "mmap", "glibc")
STATE_THRESHOLD = 128 * 1024  # glibc's initial threshold: every tensor worth its own mapping gets one
STEP_THRESHOLD = 64 * 1024 * 1024  # above glibc's 32 MiB ceiling: only the largest per-step buffers (logits) are mapped


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, loaded once (a training step calls into it); None where there is none."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _glibc_call(name: str, *args: int) -> int | None:
    """glibc's function `name` called with args; None off glibc or where it lacks the function."""
    fn = getattr(_glibc(), name, None)
    return None if fn is None else fn(*args)


def set_mmap_threshold(nbytes: int) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes): buffers of nbytes and more get their own mapping, unmapped when freed, and
    glibc stops moving the threshold by itself. Returns whether it was set (False off glibc)."""
    return bool(_glibc_call("mallopt", -3, nbytes))  # -3: M_MMAP_THRESHOLD


def trim_heap() -> bool:
    """malloc_trim(0): glibc returns the free pages of its heaps, those between buffers in use too, to the system.
    Returns whether it ran (False off glibc)."""
    return _glibc_call("malloc_trim", 0) is not None


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise UserError(f"model.malloc={policy!r}: choose one of {', '.join(POLICIES)}")


class MallocPolicy:
    """One process's policy: `start()` before the model is built; `state_ready()` once the run-long state exists
    (after each optimizer step of a fit, only the first changes anything; when a validate or predict run starts,
    its weights loaded); `zero_grad(optimizer)` in place of optimizer.zero_grad(); `before_loss()` between the model's
    forward and the loss."""

    def __init__(self, policy: str):
        check_policy(policy)
        self.active = policy if not torch.cuda.is_available() else "glibc"
        self._pending = self.active == "split"

    @property
    def keeps_grads(self) -> bool:
        """split: gradients stay allocated from step to step (zero_grad), validation included."""
        return self.active == "split"

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """split: zero each gradient in place, so it stays in the mapping of the first step, except those of 64 MiB
        and more (wte's): freed, since each step's new one gets a mapping of its own anyway, and keeping it would
        make backward hold two at once. Other policies: set every gradient to None."""
        if not self.keeps_grads:
            optimizer.zero_grad(set_to_none=True)
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if local.numel() * local.element_size() >= STEP_THRESHOLD:
                    p.grad = None
                else:
                    local.zero_()

    def before_loss(self) -> None:
        """split: the heap's free pages go back to the system before the loss, a step's high point (its logits and
        their exponentials are mapped then): the heap holds the saved activations and no freed buffers at that moment.
        Backward touches the pages it reuses again."""
        if self.active == "split" and not self._pending:
            trim_heap()

    def start(self) -> None:
        if self.active in ("split", "mmap"):
            set_mmap_threshold(STATE_THRESHOLD)

    def state_ready(self) -> None:
        if self._pending:
            self._pending = False
            set_mmap_threshold(STEP_THRESHOLD)
