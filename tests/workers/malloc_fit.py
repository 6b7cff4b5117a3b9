"""Train a small GPTModule on one CPU process with gpt_tp.train.malloc.HeapSplit(POLICY) (glibc: without it) and
report, as JSON, where glibc put its buffers: the share of the run-long tensors (weights and AdamW state; those of
128 KiB and more) that lie in the main heap, the share of the gradients there after each step, whether each
gradient kept its buffer from step to step, and whether a 1 MiB buffer
allocated before / after the first optimizer step came from the heap (a fit with sanity validation), or, with
`validate`, whether one allocated during a validate run did. With `trim`: 24 MiB of buffers freed in the heap
below one kept above them before step 2, and how much resident memory a malloc_trim at the start of the loss
then returns. With `calls`: when each of HeapSplit's mallopt calls came, "built" (before the fit started, so before
any process group) or "fit". Usage: malloc_fit.py POLICY [validate | trim | calls]"""

import json
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from gpt_tp.train import malloc
from gpt_tp.train.malloc import HeapSplit, trim_heap
from gpt_tp.train.module import GPTModule
from synthetic_data import SyntheticDataModule


def heap_range() -> tuple[int, int]:
    with open("/proc/self/maps") as f:
        line = next(line for line in f if line.rstrip().endswith("[heap]"))
    lo, hi = line.split()[0].split("-")
    return int(lo, 16), int(hi, 16)


def in_heap(t: torch.Tensor) -> bool:
    lo, hi = heap_range()
    return lo <= t.data_ptr() < hi


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Holes(GPTModule):
    """GPTModule that, before step 2, leaves 24 MiB of freed buffers in the heap below one it keeps (seven 4 MiB
    buffers, touched; six freed, the one at the highest address kept, so the freed ones cannot be trimmed from the
    heap's top), then measures at the start of that step's loss what one more malloc_trim returns to the system."""

    report: dict | None = None  # set before step 2

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 2:
            bufs = [torch.ones(1 << 20) for _ in range(7)]  # 4 MiB each
            self.report = {"in_heap": all(map(in_heap, bufs))}
            self.kept = max(bufs, key=lambda t: t.data_ptr())  # the highest: the freed ones lie below it
            del bufs

    def compute_loss(self, logits, y):
        if self.report is not None and "further_trim" not in self.report:
            before = rss_bytes()
            trim_heap()
            self.report["further_trim"] = before - rss_bytes()
        return super().compute_loss(logits, y)


class Where(Callback):
    def __init__(self):
        self.probe, self.grads_in_heap, self.grad_ptrs = {}, [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.probe.setdefault("before_first_step", in_heap(torch.ones(1 << 18)))  # 1 MiB

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self.probe.setdefault("in_validation", in_heap(torch.ones(1 << 18)))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.probe.setdefault("after_first_step", in_heap(torch.ones(1 << 18)))
        grads = [p.grad for p in module.parameters() if p.grad.numel() * p.grad.element_size() >= 128 * 1024]
        self.grads_in_heap.append(sum(map(in_heap, grads)) / len(grads))  # after each step, of the 9 big gradients
        self.grad_ptrs.append([p.grad.data_ptr() for p in module.parameters()])


class Phase(Callback):
    """Records, for each mallopt call HeapSplit makes through gpt_tp.train.malloc's _glibc_fn, the phase it came in."""

    def __init__(self):
        self.phase, self.calls = "built", []
        real = malloc._glibc_fn

        def spy(name, *types):
            fn = real(name, *types)
            if name != "mallopt" or fn is None:
                return fn
            return lambda *args: (self.calls.append(self.phase), fn(*args))[1]
        malloc._glibc_fn = spy

    def on_fit_start(self, trainer, pl_module):
        self.phase = "fit"


def main(policy: str, mode: str | None) -> None:
    torch.manual_seed(0)
    phase = Phase()
    heap = [] if policy == "glibc" else [HeapSplit(policy)]  # before the model, as cli.py builds them
    module = (Holes if mode == "trim" else GPTModule)({"n_layer": 2, "n_head": 4, "n_embd": 256, "block_size": 64},
                                                      total_batch_size=None, warmup_steps=1, max_steps=4)
    where = Where()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                        val_check_interval=2, inference_mode=False, callbacks=[*heap, where, phase])
    data = SyntheticDataModule(batch_size=2, seq_len=64)
    if mode == "trim":
        trainer.fit(module, data)
        print(json.dumps(module.report))
        return
    if mode == "validate":
        trainer.validate(module, data)
        print(json.dumps(where.probe))
        return
    if mode == "calls":
        trainer.fit(module, data)
        print(json.dumps({"mallopt": phase.calls}))
        return
    trainer.fit(module, data)  # a sanity validation before the first step, one after step 2
    opt = module.optimizers().optimizer
    big = lambda t: t is not None and t.dim() and t.numel() * t.element_size() >= 128 * 1024  # noqa: E731
    state = [t for p in module.parameters() for t in (p, *opt.state[p].values()) if big(t)]
    print(json.dumps({"state_in_heap": sum(map(in_heap, state)) / len(state), "n_state": len(state),
                      "grads_in_heap": where.grads_in_heap,
                      "grads_kept": all(ptrs == where.grad_ptrs[0] for ptrs in where.grad_ptrs), **where.probe}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
