"""HeapSplit: a CPU run's long-lived buffers in mappings of their own, its per-step buffers in glibc's heap, so the
heap stops growing to a fragmented high-water mark (configs/cpu.yaml lists it; docs/train.md, docs/performance.md)."""

import ctypes
import functools

import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from gpt_tp.errors import UserError

POLICIES = ("split", "mmap")
M_MMAP_THRESHOLD = -3  # mallopt's parameter: the size from which a buffer gets its own mapping, unmapped when freed
STATE_THRESHOLD = 128 * 1024  # glibc's initial threshold: every tensor worth its own mapping gets one
STEP_THRESHOLD = 64 * 1024 * 1024  # above glibc's 32 MiB ceiling: only the largest per-step buffers (logits) are mapped


@functools.cache
def _glibc_fn(name: str, *argtypes):
    """glibc's function `name` (these argument types, int result), loaded once; None off glibc or where it lacks it."""
    try:
        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)((name, ctypes.CDLL("libc.so.6")))
    except (OSError, AttributeError):
        return None


def set_mmap_threshold(nbytes: int) -> None:
    if (fn := _glibc_fn("mallopt", ctypes.c_int, ctypes.c_int)) is not None:
        fn(M_MMAP_THRESHOLD, nbytes)


def trim_heap() -> bool:
    """malloc_trim(0): glibc returns its heaps' free pages, those between buffers in use too. Returns whether it ran."""
    return (fn := _glibc_fn("malloc_trim", ctypes.c_size_t)) is not None and fn(0) >= 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class HeapSplit(Callback):
    """Where a CPU run's buffers live. policy: "split" (run-long state in mappings, step buffers in the heap) or "mmap"
    (every buffer from 128 KiB up in its own mapping); no effect where CUDA is available or off glibc."""

    def __init__(self, policy: str = "split"):
        if policy not in POLICIES:
            raise UserError(f"HeapSplit(policy={policy!r}): choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.active = not torch.cuda.is_available()
        self._pending = self.active and policy == "split"  # the run-long state is not all there yet
        self._hook = None
        self._grads: list = []  # (parameter, its gradient) held from one optimizer step to the next backward
        if self.active:  # from here on: cli.py builds the trainer's callbacks before the model
            set_mmap_threshold(STATE_THRESHOLD)  # glibc stops moving the threshold

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.active and self.policy == "split" and self._hook is None:
            self._hook = pl_module.model.register_forward_hook(self._before_loss)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _before_loss(self, module, args, output) -> None:
        """After the model's forward, before the loss, once the state exists: the heap's free pages go back."""
        if not self._pending and module.training:
            trim_heap()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """split: hold this step's gradients, which Lightning frees before the next backward, and hand them back zeroed
        (on_before_backward), so each stays in the first step's mapping; those of STEP_THRESHOLD and more (wte's) are
        left to be freed, or backward would hold two at once."""
        if self.active and self.policy == "split":
            self._grads = [(p, p.grad) for p in pl_module.parameters()
                           if p.grad is not None and _local(p.grad).nbytes < STEP_THRESHOLD]

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        for p, g in self._grads:
            if p.grad is None:  # freed by zero_grad, as it should be: the same buffer, zeroed
                _local(g).zero_()
                p.grad = g
        self._grads = []

    def _state_ready(self) -> None:
        if self._pending:
            self._pending = False
            set_mmap_threshold(STEP_THRESHOLD)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > 0:  # the first optimizer step has returned: the optimizer state exists
            self._state_ready()

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":  # not a fit's validation, which may come before the first step
            self._state_ready()

    def on_predict_start(self, trainer, pl_module) -> None:
        self._state_ready()
