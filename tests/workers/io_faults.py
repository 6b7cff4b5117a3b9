"""Callbacks that break the checkpoint folder mid-run, on rank 0, after a given optimizer step (tests/test_io_faults.py)."""

import os
import shutil
import signal
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


class KillAtRelink(Callback):
    """From `step` on, the first time Lightning makes last.ckpt again after deleting it, SIGKILL the whole run (the
    test starts it in a session of its own) between the two: what a kill at that moment leaves on disk."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step < self.step or not trainer.is_global_zero:
            return
        def kill(src, dst, *args, **kwargs):
            os.killpg(os.getpgid(0), signal.SIGKILL)

        os.symlink = kill  # this process only: the next call is Lightning's relink of last.ckpt, after deleting it
