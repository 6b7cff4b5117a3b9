"""The Lightning internals gpt_tp.train.lightning_internals relies on still work as it expects: a Lightning upgrade that
changes one fails here, by name, before it breaks a resume."""

from types import SimpleNamespace

import lightning
from lightning.pytorch.callbacks import ModelCheckpoint

from gpt_tp.train.lightning_internals import CHECKED, mark_saved


def test_checked_against_this_lightning():
    assert lightning.__version__.startswith(CHECKED), (
        f"lightning {lightning.__version__} is not among {CHECKED}: check gpt_tp/train/lightning_internals.py against it")


def test_a_step_marked_saved_is_not_saved_again():
    """ModelCheckpoint skips saving a step it has saved: mark_saved makes the resumed step count as saved."""
    cb = ModelCheckpoint(dirpath="unused", every_n_train_steps=1)
    trainer = SimpleNamespace(fast_dev_run=False, sanity_checking=False, global_step=7,
                              state=SimpleNamespace(fn="fit"))
    assert not cb._should_skip_saving_checkpoint(trainer)
    mark_saved(cb, 7)
    assert cb._should_skip_saving_checkpoint(trainer)
