"""The one place gpt_tp touches Lightning internals (no public seam), checked on the versions in CHECKED, which
tests/test_lightning_internals.py guards. Lightning's ModelCheckpoint does not restore its last saved step on resume,
so with gradient accumulation the loaded step would be saved again as `<step>-v1.ckpt` (mark_saved); and it moves
last.ckpt by deleting and remaking the link (a kill between leaves none): ModelCheckpoint renames a new one over it.
A distributed checkpoint's non-tensor file has Lightning's private name (META). `cli.py validate` restores no
step: show_step makes its logged rows and lines name the checkpoint's step."""

import os
import shutil

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

CHECKED = ("2.6",)  # lightning.__version__ prefixes this module was checked against
META = "meta.pt"  # a distributed checkpoint's non-tensor part, by Lightning's name (fabric's _METADATA_FILENAME)


def mark_saved(callback: LightningModelCheckpoint, step: int) -> None:
    """Count `step` as saved by `callback` (the step a run resumes from)."""
    if not hasattr(callback, "_last_global_step_saved"):
        raise RuntimeError("lightning's ModelCheckpoint has no _last_global_step_saved any more: update "
                           "gpt_tp/train/lightning_internals.py for this Lightning version")
    callback._last_global_step_saved = step


def show_step(trainer, step: int) -> None:
    """trainer.global_step (the HellaSwag line's step) and the step the loggers write become `step`; for a run that
    trains no step (validate), which Lightning leaves at 0."""
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
    epoch_loop.manual_optimization.optim_step_progress.total.completed = step
    epoch_loop._batches_that_stepped = step  # the logger connector's step


class AtomicModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint (the same arguments), last.ckpt always naming a step; a name of its own, so
    `--trainer.callbacks+=ModelCheckpoint` stays Lightning's short name. A last.ckpt that is a folder
    (a run that ended between saves) is first moved to `last.ckpt.old`, for checkpoint.recover_interrupted_saves."""

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            new = linkpath + ".new"
            if os.path.lexists(new):  # a killed run's leftover
                os.remove(new)
            os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), new)
            if os.path.isdir(linkpath) and not os.path.islink(linkpath):
                os.rename(linkpath, linkpath + ".old")
                os.replace(new, linkpath)
                shutil.rmtree(linkpath + ".old")
            else:
                os.replace(new, linkpath)  # atomic: a link renamed over a link (or a file)
        trainer.strategy.barrier()
