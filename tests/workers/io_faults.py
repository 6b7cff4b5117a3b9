"""Callbacks that break the checkpoint folder mid-run, on rank 0, after a given optimizer step (tests/test_io_faults.py)."""

import shutil
import subprocess

from lightning.pytorch.callbacks import Callback


class BreakFolder(Callback):
    """After `step`: `how` = "read-only" remounts `path` (a tmpfs the test mounted) read-only; "remove" deletes it."""

    def __init__(self, path: str, step: int, how: str):
        self.path, self.step, self.how, self.done = path, step, how, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.done or trainer.global_step < self.step:
            return
        self.done = True
        if trainer.is_global_zero:
            if self.how == "read-only":
                subprocess.run(["mount", "-o", "remount,ro", self.path], check=True)
            else:
                shutil.rmtree(self.path)
        trainer.strategy.barrier()
