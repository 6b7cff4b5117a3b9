"""HeapSplit: where a CPU run's buffers live in glibc, set once before the run's threads start
(configs/cpu.yaml lists it; docs/train.md, docs/performance.md)."""

import ctypes
import functools

import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from gpt_tp.errors import UserError

M_MMAP_THRESHOLD = -3  # mallopt's parameter: the size from which a buffer gets its own mapping, unmapped when freed
THRESHOLDS = {"split": 64 * 1024 * 1024,  # above glibc's 32 MiB ceiling: only the largest buffers (wte, logits) mapped
              "mmap": 128 * 1024}  # glibc's initial threshold: every buffer from 128 KiB up mapped


@functools.cache
def _glibc_fn(name: str, *argtypes):
    """glibc's function `name` (int result, these argument types), loaded at first use and kept; None off glibc or
    where it lacks the function."""
    try:
        fn = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def trim_heap() -> bool:
    """malloc_trim(0) (MT-Safe): glibc returns its heaps' free pages, those between buffers in use too. Returns
    whether it ran."""
    return (fn := _glibc_fn("malloc_trim", ctypes.c_size_t)) is not None and fn(0) >= 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class HeapSplit(Callback):
    """Where a CPU run's buffers live. policy: "split" (buffers under 64 MiB in the heap, its free pages returned
    after each forward, gradients kept from step to step) or "mmap" (every buffer from 128 KiB up in its own mapping);
    no effect where CUDA is available or off glibc."""

    def __init__(self, policy: str = "split"):
        if policy not in THRESHOLDS:
            raise UserError(f"HeapSplit(policy={policy!r}): choose one of {', '.join(THRESHOLDS)}")
        self.policy = policy
        self.active = not torch.cuda.is_available()
        self._hook = None
        self._grads: list = []  # (parameter, its gradient) held from one optimizer step to the next backward
        if self.active and (fn := _glibc_fn("mallopt", ctypes.c_int, ctypes.c_int)) is not None:
            # mallopt is MT-Unsafe: called once, here (cli.py builds the trainer's callbacks before the process
            # group and the model); glibc stops moving the threshold
            fn(M_MMAP_THRESHOLD, THRESHOLDS[policy])

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.active and self.policy == "split" and self._hook is None:
            self._hook = pl_module.model.register_forward_hook(self._before_loss)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _before_loss(self, module, args, output) -> None:
        """After the model's forward, before the loss: the heap's free pages go back."""
        if module.training:
            trim_heap()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """split: hold this step's gradients, which Lightning frees before the next backward, and hand them back zeroed
        (on_before_backward), so each keeps its buffer; those of 64 MiB and more (wte's) are left to be freed, or
        backward would hold two at once."""
        if self.active and self.policy == "split":
            self._grads = [(p, p.grad) for p in pl_module.parameters()
                           if p.grad is not None and _local(p.grad).nbytes < THRESHOLDS["split"]]

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        for p, g in self._grads:
            if p.grad is None:  # freed by zero_grad, as it should be: the same buffer, zeroed
                _local(g).zero_()
                p.grad = g
        self._grads = []
