"""The one place gpt_tp touches Lightning internals, where Lightning has no public seam. Checked against the Lightning
versions in CHECKED (pyproject caps Lightning below the next minor); tests/test_lightning_internals.py fails loudly
when an internal used here changes.
- ModelCheckpoint's last saved step is not restored on resume, so with gradient accumulation the loaded step would be
  saved again as `<step>-v1.ckpt`: mark_saved sets it.
- ModelCheckpoint moves last.ckpt to a new step by deleting the link and making it again, so a kill in between
  leaves no last.ckpt: ModelCheckpoint here replaces its _link_checkpoint with a new link beside it, renamed over it."""

import os
import shutil

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

CHECKED = ("2.6",)  # lightning.__version__ prefixes this module was checked against


def mark_saved(callback: LightningModelCheckpoint, step: int) -> None:
    """Count `step` as saved by `callback` (the step a run resumes from)."""
    if not hasattr(callback, "_last_global_step_saved"):
        raise RuntimeError("lightning's ModelCheckpoint has no _last_global_step_saved any more: update "
                           "gpt_tp/train/lightning_internals.py for this Lightning version")
    callback._last_global_step_saved = step


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint (the same arguments) whose last.ckpt names the old step or the new one at every
    moment: the new link is made beside it (`last.ckpt.new`) and renamed over it. A last.ckpt that is a checkpoint
    folder of its own (a run that ended between saves) is moved to `last.ckpt.old` first, which
    gpt_tp.train.checkpoint.recover_interrupted_saves puts back should a kill come before the rename."""

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
