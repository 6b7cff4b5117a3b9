"""The one place gpt_tp touches Lightning internals (no public seam), checked on the versions in CHECKED, which
tests/test_lightning_internals.py guards. Lightning's ModelCheckpoint does not restore its last saved step on resume,
so with gradient accumulation the loaded step would be saved again as `<step>-v1.ckpt` (mark_saved); it saves a step
only from its own hooks (save_step: the final step, a stopped run's step) and names a second checkpoint of a name
`<name>-v1.ckpt` (replace_same_names); and it moves last.ckpt by deleting and remaking the link (a kill between leaves
none): AtomicModelCheckpoint renames a new one over it. ModelParallelStrategy builds its DeviceMesh inside
setup_environment from private sizes (setup_with_mesh: with gpt_tp's one builder). Also Lightning's private names of a
distributed checkpoint's non-tensor file (META) and of the step `cli.py validate` logs at (show_step)."""

import os
import shutil

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from gpt_tp.ranks import Layout, build_mesh

CHECKED = ("2.6",)  # lightning.__version__ prefixes this module was checked against
META = "meta.pt"  # a distributed checkpoint's non-tensor part, by Lightning's name (fabric's _METADATA_FILENAME)


def mark_saved(callback: LightningModelCheckpoint, step: int) -> None:
    """Count `step` as saved by `callback` (the step a run resumes from)."""
    if not hasattr(callback, "_last_global_step_saved"):
        raise RuntimeError("lightning's ModelCheckpoint has no _last_global_step_saved any more: update "
                           "gpt_tp/checkpoint/lightning_internals.py for this Lightning version")
    callback._last_global_step_saved = step


def setup_with_mesh(strategy: ModelParallelStrategy) -> None:
    """ModelParallelStrategy.setup_environment with build_mesh's DeviceMesh ("auto" sizes resolved as Lightning does)."""
    super(ModelParallelStrategy, strategy).setup_environment()
    strategy._setup_distributed()
    dp, tp = strategy._data_parallel_size, strategy._tensor_parallel_size
    dp, tp = strategy.num_nodes if dp == "auto" else dp, strategy.num_processes if tp == "auto" else tp
    if dp * tp != strategy.world_size:  # Lightning's words
        raise RuntimeError(f"The sizes `data_parallel_size={dp}` and `tensor_parallel_size={tp}` multiplied should "
                           f"equal the world size ({strategy.world_size}).")
    strategy._device_mesh = strategy.lightning_module._device_mesh = build_mesh(Layout(dp, tp), strategy.root_device.type)


def show_step(trainer, step: int) -> None:
    """trainer.global_step (the HellaSwag line's step) and the step the loggers write become `step`; for a run that
    trains no step (validate), which Lightning leaves at 0."""
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
    epoch_loop.manual_optimization.optim_step_progress.total.completed = step
    epoch_loop._batches_that_stepped = step  # the logger connector's step


def replace_same_names(callback: LightningModelCheckpoint) -> None:
    """Save a checkpoint whose name exists over it (ModelParallel publishes it atomically), never as `<name>-v1.ckpt`:
    `last.ckpt` then always names this run's newest checkpoint."""
    if not hasattr(callback, "_enable_version_counter"):
        raise RuntimeError("lightning's ModelCheckpoint has no _enable_version_counter any more: update "
                           "gpt_tp/checkpoint/lightning_internals.py for this Lightning version")
    callback._enable_version_counter = False


def save_step(callback: LightningModelCheckpoint, trainer) -> str | None:
    """Save the trainer's step now as `callback` saves a periodic one (top-k file, then last.ckpt), unless it has
    already; every rank calls it. Returns the newest checkpoint `callback` has saved (None: none)."""
    if trainer.global_step > 0 and not callback._should_skip_saving_checkpoint(trainer):
        candidates = callback._monitor_candidates(trainer)
        if callback.save_last in (None, False, "link"):  # save_last true: last.ckpt, a copy of its own, is the save
            callback._save_topk_checkpoint(trainer, candidates)
            if callback.save_top_k != 0 and callback._last_global_step_saved != trainer.global_step:  # not in the top k
                callback._save_checkpoint(trainer, callback.format_checkpoint_name(candidates))
        callback._save_last_checkpoint(trainer, candidates)
    return callback._last_checkpoint_saved or None


class AtomicModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint (the same arguments), last.ckpt always naming a step; a name of its own, so
    `--trainer.callbacks+=ModelCheckpoint` stays Lightning's short name. A last.ckpt that is a folder
    (a run that ended between saves) is first moved to `last.ckpt.old`, for checkpoint.recover_interrupted_saves."""

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        def link() -> None:
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

        getattr(trainer.strategy, "when_committed", lambda act: act())(link)  # an asynchronous save: once committed
