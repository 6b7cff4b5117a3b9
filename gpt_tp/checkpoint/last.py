"""The newest checkpoint: the final step saved (FinalStep), found (latest_checkpoint), relinked (relink_last)."""

import os
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint as LightningModelCheckpoint

from gpt_tp.checkpoint.lightning_internals import META, replace_same_names, save_step


def checkpoints_line(trainer) -> str:
    """The closing line's account of the run's checkpoints, from each ModelCheckpoint's own last checkpoint:
    `checkpoints in DIR (last.ckpt -> step0000013.ckpt)`; '' when none was saved."""
    parts = []
    for cb in trainer.checkpoint_callbacks:
        last = getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "") or ""  # save_last or not
        if last and os.path.lexists(last):
            link = f" -> {os.readlink(last)}" if os.path.islink(last) else ""
            parts.append(f"checkpoints in {cb.dirpath} ({os.path.basename(last)}{link})")
    return "; ".join(parts)


class FinalStep(Callback):
    """Every ModelCheckpoint saves the run's final step, whatever its every_n_train_steps (build-nanogpt saves at
    `step % N == 0 or last_step`), once, with last.ckpt naming it; and saves a name that exists over it, never as
    `<name>-v1.ckpt`. cli.py adds it to every run."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        for cb in (c for c in trainer.checkpoint_callbacks if isinstance(c, LightningModelCheckpoint)):
            replace_same_names(cb)

    def on_train_end(self, trainer, pl_module) -> None:  # before the ModelCheckpoints' own (Lightning puts them last)
        for cb in (c for c in trainer.checkpoint_callbacks if isinstance(c, LightningModelCheckpoint)):
            save_step(cb, trainer)


def latest_checkpoint(*dirs: str) -> str | None:
    """The most recently completed `*.ckpt` directly in any of `dirs`: a file once not empty, a distributed-checkpoint
    folder once its meta.pt (written last) is there."""
    done = {p: p / META if p.is_dir() else p for d in dirs if Path(d).is_dir() for p in Path(d).glob("*.ckpt")}
    found = {p: f.stat().st_mtime for p, f in done.items() if f.is_file() and (f != p or f.stat().st_size > 0)}
    return str(max(found, key=found.get)) if found else None


def relink_last(folders: set[str]) -> bool:
    """A run killed between Lightning's unlink and relink of last.ckpt leaves no last.ckpt, and `--ckpt_path last`
    would start from step 0: link it to the newest complete checkpoint again, and say so. False: none to link."""
    newest = latest_checkpoint(*sorted(folders))
    if newest is None:
        return False
    folder, name = os.path.split(newest)
    try:
        os.symlink(name, os.path.join(folder, "last.ckpt"))  # relative, as Lightning links it
    except FileExistsError:  # another rank's CLI did it first
        return True
    print(f"gpt_tp: {folder} had no last.ckpt (a run killed while moving it): linked it to {name}", file=sys.stderr)
    return True
