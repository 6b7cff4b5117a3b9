"""Logging that fails every rank alike (docs/train.md, "What is logged"): a failed write on rank 0, which alone writes
metrics.csv, is held by the loggers and raised on every rank by LogWriteCheck, not left to end rank 0 alone."""

import os
import traceback

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger, TensorBoardLogger as LightningTensorBoardLogger

from gpt_tp.collective import one_does
from gpt_tp.train.lightning_internals import show_step


class HeldWrites:
    """A logger whose first failed write (an OSError: full disk, quota, read-only) is kept in `write_error` for
    LogWriteCheck instead of raised on rank 0 alone; later writes are skipped."""

    write_error: OSError | None = None
    file = "metrics.csv"  # what log_metrics writes, for the error line

    def _guard(self, name: str, write, *args, **kwargs) -> None:
        if self.write_error is None:
            try:
                write(*args, **kwargs)
            except OSError as e:  # named with the file: Python's write() error carries none
                filename = os.fsdecode(e.filename) if e.filename else os.path.join(self.log_dir, name)
                self.write_error = OSError(e.errno, e.strerror, filename)

    def log_hyperparams(self, *args, **kwargs) -> None:
        self._guard("hparams.yaml", super().log_hyperparams, *args, **kwargs)

    def log_metrics(self, *args, **kwargs) -> None:
        self._guard(self.file, super().log_metrics, *args, **kwargs)

    def save(self) -> None:
        self._guard(self.file, super().save)

    def finalize(self, status: str) -> None:
        if self.write_error is None:  # after a held failure, closing the file would only raise it again
            super().finalize(status)


class HeldCSVLogger(HeldWrites, LightningCSVLogger):
    """Lightning's CSVLogger, its writes held (HeldWrites); a name of its own, so `--trainer.logger=CSVLogger` stays
    Lightning's short name."""


class HeldTensorBoardLogger(HeldWrites, LightningTensorBoardLogger):
    """Lightning's TensorBoardLogger, its writes held: its writer thread's error comes back at the next write."""

    file = "the TensorBoard event file"


def quiet_writer_threads(previous):
    """A threading.excepthook that passes over an OSError in TensorBoard's event-writer thread (the logger raises it
    again at its next write, where HeldWrites keeps it for LogWriteCheck) and hands everything else to `previous`."""
    def hook(args) -> None:
        frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback else []
        if isinstance(args.exc_value, OSError) and any("event_file_writer" in f.filename for f in frames):
            return
        previous(args)

    return hook


class LogWriteCheck(Callback):
    """Every rank stops with rank 0's logger write error, at the next training batch or at the end of training."""

    def _check(self, trainer) -> None:
        held = [lg for lg in trainer.loggers if isinstance(lg, HeldWrites)]  # alike on all ranks: all or none reduce
        errors = [lg.write_error for lg in held if lg.write_error is not None]
        if held and trainer.strategy.reduce_boolean_decision(bool(errors), all=False):
            def fail() -> None:
                if errors:
                    raise errors[0]

            one_does(fail)  # rank 0's error on every rank (gpt_tp.collective)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # once per optimizer step
            self._check(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._check(trainer)


class CheckpointStep(Callback):
    """`cli.py validate` labels its results (metrics.csv's step, the HellaSwag line) with the checkpoint's step."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.state.fn == "validate" and "global_step" in checkpoint:
            show_step(trainer, checkpoint["global_step"])
