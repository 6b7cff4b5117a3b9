"""The one place gpt_tp touches a Lightning internal, where Lightning has no public seam. Checked against the
Lightning versions in CHECKED (pyproject caps Lightning below the next minor); tests/test_lightning_internals.py
fails loudly when an internal used here changes. ModelCheckpoint's last saved step is not restored on resume, so
with gradient accumulation the loaded step would be saved again as `<step>-v1.ckpt`: mark_saved sets it."""

from lightning.pytorch.callbacks import ModelCheckpoint

CHECKED = ("2.6",)  # lightning.__version__ prefixes this module was checked against


def mark_saved(callback: ModelCheckpoint, step: int) -> None:
    """Count `step` as saved by `callback` (the step a run resumes from)."""
    if not hasattr(callback, "_last_global_step_saved"):
        raise RuntimeError("lightning's ModelCheckpoint has no _last_global_step_saved any more: update "
                           "gpt_tp/train/lightning_internals.py for this Lightning version")
    callback._last_global_step_saved = step
