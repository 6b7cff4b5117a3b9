"""Logging that fails every rank alike. Rank 0 alone writes metrics.csv (Lightning's loggers are rank-zero-only), so a
full disk there used to end rank 0 with an error and leave the other ranks to die inside their next collective with
gloo's "Connection closed by peer". CSVLogger holds a failed write; LogWriteCheck (GPTCLI adds it) takes one tiny
all-reduce per optimizer step, before the step's collectives, and when rank 0 holds an error every rank raises it.
"""

import os

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger

from gpt_tp.collective import one_does


class CSVLogger(LightningCSVLogger):
    """Lightning's CSVLogger whose first failed write (an OSError: a full disk, a quota, a read-only file system) is
    kept in `write_error` for LogWriteCheck instead of raised on rank 0 alone; later writes are skipped."""

    write_error: OSError | None = None

    def _guard(self, name: str, write, *args, **kwargs) -> None:
        if self.write_error is None:
            try:
                write(*args, **kwargs)
            except OSError as e:  # named with the file: Python's write() error carries none
                self.write_error = OSError(e.errno, e.strerror, e.filename or os.path.join(self.log_dir, name))

    def log_hyperparams(self, *args, **kwargs) -> None:
        self._guard("hparams.yaml", super().log_hyperparams, *args, **kwargs)

    def log_metrics(self, *args, **kwargs) -> None:
        self._guard("metrics.csv", super().log_metrics, *args, **kwargs)

    def save(self) -> None:
        self._guard("metrics.csv", super().save)


class LogWriteCheck(Callback):
    """Every rank stops with rank 0's logger write error, at the next training batch or at the end of training."""

    def _check(self, trainer) -> None:
        if not any(isinstance(lg, CSVLogger) for lg in trainer.loggers):  # the same answer on every rank
            return
        errors = [lg.write_error for lg in trainer.loggers if getattr(lg, "write_error", None) is not None]
        if trainer.strategy.reduce_boolean_decision(bool(errors), all=False):

            def fail() -> None:
                if errors:
                    raise errors[0]

            one_does(fail)  # rank 0's error on every rank (gpt_tp.collective)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # once per optimizer step
            self._check(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._check(trainer)
