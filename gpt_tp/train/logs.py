"""Logging that fails every rank alike (docs/train.md, "What is logged"), Lightning's lines a run does without; the
run's lineage and checkpoint step."""

import json
import logging
import os
import threading
import traceback
import uuid
import warnings

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger, TensorBoardLogger as LightningTensorBoardLogger

from gpt_tp.collective import one_does
from gpt_tp.checkpoint.contents import Contents
from gpt_tp.checkpoint.lightning_internals import show_step


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
    """Lightning's CSVLogger, writes held; named apart so `--trainer.logger=CSVLogger` stays Lightning's short name."""


class HeldTensorBoardLogger(HeldWrites, LightningTensorBoardLogger):
    """Lightning's TensorBoardLogger, its writes held: its writer thread's error comes back at the next write."""

    file = "the TensorBoard event file"


def quiet_lightning() -> None:
    """Silence Lightning's lines a gpt_tp user can do nothing about; every rank runs this (gpt_tp.cli.main)."""
    # Lightning's info lines that say nothing about a gpt_tp run, or that the closing line says instead
    quiet = ("💡 Tip: For seamless cloud", "`Trainer.fit` stopped:",
             "Trainer already configured with model summary callbacks")  # the last: cli.py adds GPTSummary
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not record.getMessage().startswith(quiet))
    previous = threading.excepthook

    def hook(args) -> None:  # an OSError in TensorBoard's writer thread comes back at the logger's next write
        frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback else []
        if not (isinstance(args.exc_value, OSError) and any("event_file_writer" in f.filename for f in frames)):
            previous(args)

    threading.excepthook = hook
    # Lightning 2.6's own pytree code on torch 2.13, once per rank
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # predict's prompts are a plain iterable on purpose (every rank runs every prompt): no batch indices to infer
    warnings.filterwarnings("ignore", message="Couldn't infer the batch indices fetched from your dataloader: `PromptBatches`")


class LogWriteCheck(Callback):
    """Every rank stops with rank 0's logger write error, at the next optimizer step (its flag summed in the step's
    all-reduce: GPTModule.on_before_optimizer_step) or at the end of training."""

    def step_flags(self, trainer) -> list[float]:
        return [any(getattr(lg, "write_error", None) is not None for lg in trainer.loggers)]

    def flags_summed(self, trainer, sums: list[float]) -> None:
        def fail() -> None:
            if errors := [lg.write_error for lg in trainer.loggers if getattr(lg, "write_error", None) is not None]:
                raise errors[0]
        if sums[0]:
            one_does(fail)  # rank 0's error on every rank (gpt_tp.collective)

    def on_train_end(self, trainer, pl_module) -> None:
        if any(isinstance(lg, HeldWrites) for lg in trainer.loggers):  # alike on all ranks: all or none reduce
            self.flags_summed(trainer, [trainer.strategy.reduce_boolean_decision(self.step_flags(trainer)[0], all=False)])


class CheckpointStep(Callback):
    """`cli.py validate` labels its results (metrics.csv's step, the HellaSwag line) with the checkpoint's step."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.state.fn == "validate" and (step := Contents.of(checkpoint).step) is not None:
            show_step(trainer, step)


LINEAGE = "lineage.json"  # in each logger's log_dir: {"run": this run's id, "ancestors": the runs it continues}


class RunLineage(Callback):
    """A run's identity through its checkpoints, for `python -m gpt_tp.train.plot`: each run (one id from rank 0) saves
    its ancestors' ids and its own in every checkpoint and writes them to its log folder's lineage.json, so a run that
    resumes from or validates a checkpoint has as ancestors exactly the runs that trained it, wherever it lies."""

    def __init__(self):
        self.run, self.ancestors = None, []

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.run = trainer.strategy.broadcast(uuid.uuid4().hex)

    def state_dict(self) -> dict:
        return {"runs": [*self.ancestors, self.run]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.ancestors = list(state_dict["runs"])

    def _record(self, trainer) -> None:
        def write() -> None:
            for folder in {lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)}:
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, LINEAGE), "w", encoding="utf-8") as f:
                    json.dump({"run": self.run, "ancestors": self.ancestors}, f)

        one_does(write)  # rank 0 writes; a failed write ends every rank alike

    def on_train_start(self, trainer, pl_module) -> None:
        self._record(trainer)  # after a resume's load_state_dict (ModelParallelStrategy restores after on_fit_start)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            self._record(trainer)
