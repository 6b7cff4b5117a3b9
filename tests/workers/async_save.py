"""A callback for tests/test_async_save.py: background checkpoint writes made slow, watched at each step, and the run
killed while one is being written."""

import json
import os
import signal
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint import FileSystemWriter

from gpt_tp.errors import UserError


class SlowWrite(Callback):
    """Every rank's checkpoint write (DCP's FileSystemWriter.write_data, which reads the staged copy) starts `delay_s`
    late, so training runs on meanwhile. At each batch's start rank 0 appends to `record` a JSON line: the step, the
    checkpoint folder's entries and what its last.ckpt names; at step `kill_at` it SIGKILLs the whole run (the test
    starts it in a session of its own); at step `fail_at` every rank raises a UserError."""

    def __init__(self, delay_s: float, record: str, kill_at: int = -1, fail_at: int = -1):
        self.delay_s, self.record, self.kill_at, self.fail_at = delay_s, record, kill_at, fail_at

    def setup(self, trainer, pl_module, stage: str) -> None:
        write, delay = FileSystemWriter.write_data, self.delay_s

        def slow(writer, plan, planner):
            time.sleep(delay)
            return write(writer, plan, planner)

        FileSystemWriter.write_data = slow

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.fail_at:
            raise UserError(f"injected failure at step {self.fail_at}")
        if not trainer.is_global_zero:
            return
        folder = Path(trainer.checkpoint_callback.dirpath)
        last = folder / "last.ckpt"
        seen = {"step": trainer.global_step, "entries": sorted(os.listdir(folder)) if folder.is_dir() else [],
                "last": os.readlink(last) if last.is_symlink() else None}
        with open(self.record, "a") as f:
            f.write(json.dumps(seen) + "\n")
        if trainer.global_step == self.kill_at:
            os.killpg(os.getpgid(0), signal.SIGKILL)
