"""The Lightning internals gpt_tp.checkpoint.lightning_internals relies on still work as it expects: a Lightning upgrade that
changes one fails here, by name, before it breaks a resume."""

import os
from types import SimpleNamespace

import lightning
from lightning.pytorch.callbacks import ModelCheckpoint

from gpt_tp.checkpoint.lightning_internals import CHECKED, META, mark_saved


def test_checked_against_this_lightning():
    assert lightning.__version__.startswith(CHECKED), (
        f"lightning {lightning.__version__} is not among {CHECKED}: check gpt_tp/checkpoint/lightning_internals.py against it")


def test_meta_is_lightnings_metadata_file_name():
    """gpt_tp's checks of a complete distributed checkpoint (check_checkpoint, latest_checkpoint) look for the file
    Lightning writes the non-tensor state to, by its private name."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    assert META == _METADATA_FILENAME


def test_model_parallel_takes_lightnings_arguments_by_name():
    """gpt_tp.checkpoint.ModelParallel passes its arguments to ModelParallelStrategy by keyword: each one is
    still a parameter there (async_save is its own)."""
    import inspect

    from lightning.pytorch.strategies import ModelParallelStrategy

    from gpt_tp.checkpoint import ModelParallel

    ours = list(inspect.signature(ModelParallel.__init__).parameters)[1:]
    assert set(ours) - {"async_save"} <= set(inspect.signature(ModelParallelStrategy.__init__).parameters)


def test_setup_with_mesh_does_what_lightnings_setup_environment_does():
    """setup_with_mesh is ModelParallelStrategy.setup_environment with gpt_tp's mesh builder: Lightning's must still be
    its parent's setup, the process group, the "auto" sizes and one mesh given to the strategy and the module, so that
    replacing it leaves nothing out (tests/test_layout.py runs it on 4 processes)."""
    import inspect
    import re

    from lightning.pytorch.strategies import ModelParallelStrategy

    code = re.sub(r"\s+", " ", inspect.getsource(ModelParallelStrategy.setup_environment))
    for step in ("super().setup_environment()", "self._setup_distributed()",
                 'if self._data_parallel_size == "auto": self._data_parallel_size = self.num_nodes',
                 'if self._tensor_parallel_size == "auto": self._tensor_parallel_size = self.num_processes',
                 "self._device_mesh = _setup_device_mesh( self._data_parallel_size, self._tensor_parallel_size, "
                 "self.world_size, self.root_device )", "self.lightning_module._device_mesh = self._device_mesh"):
        assert step in code, step
    assert len(re.findall(r"\bself\.\w+\(| = ", code)) == 5  # no call or assignment beyond those
    assert ModelParallelStrategy.device_mesh.fget(SimpleNamespace(_device_mesh="mesh")) == "mesh"


def test_a_step_marked_saved_is_not_saved_again():
    """ModelCheckpoint skips saving a step it has saved: mark_saved makes the resumed step count as saved."""
    cb = ModelCheckpoint(dirpath="unused", every_n_train_steps=1)
    trainer = SimpleNamespace(fast_dev_run=False, sanity_checking=False, global_step=7,
                              state=SimpleNamespace(fn="fit"))
    assert not cb._should_skip_saving_checkpoint(trainer)
    mark_saved(cb, 7)
    assert cb._should_skip_saving_checkpoint(trainer)


def test_last_link_is_moved_by_link_checkpoint():
    """Lightning moves last.ckpt through the static ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath):
    gpt_tp's ModelCheckpoint replaces that method, so it must still be the one place the link is made."""
    import inspect

    assert isinstance(inspect.getattr_static(ModelCheckpoint, "_link_checkpoint"), staticmethod)
    assert list(inspect.signature(ModelCheckpoint._link_checkpoint).parameters) == ["trainer", "filepath", "linkpath"]
    assert "self._link_checkpoint(trainer, " in inspect.getsource(ModelCheckpoint._save_last_checkpoint)


def test_atomic_last_link(tmp_path):
    """gpt_tp's _link_checkpoint: a new link renamed over the old one (or over a last.ckpt folder of its own, moved
    aside first), a killed run's `.new` leftover replaced; last.ckpt names a checkpoint at every step."""
    from gpt_tp.checkpoint import AtomicModelCheckpoint as Atomic

    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda: None))
    for step in ("step3.ckpt", "step6.ckpt", "step9.ckpt"):
        (tmp_path / step).mkdir()
    last = tmp_path / "last.ckpt"
    last.mkdir()  # a run that ended between saves: last.ckpt is a folder of its own
    (last / "meta.pt").write_text("x")
    Atomic._link_checkpoint(trainer, str(tmp_path / "step3.ckpt"), str(last))
    assert os.readlink(last) == "step3.ckpt" and not (tmp_path / "last.ckpt.old").exists()
    os.symlink("step3.ckpt", tmp_path / "last.ckpt.new")  # what a kill between the two steps leaves
    Atomic._link_checkpoint(trainer, str(tmp_path / "step6.ckpt"), str(last))
    assert os.readlink(last) == "step6.ckpt" and sorted(os.listdir(tmp_path)) == ["last.ckpt", "step3.ckpt", "step6.ckpt", "step9.ckpt"]


def test_show_step_sets_the_step_trainer_and_loggers_report(tmp_path):
    """show_step: trainer.global_step and the step the logger connector writes rows under become the given step."""
    import inspect

    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    from gpt_tp.checkpoint.lightning_internals import show_step

    trainer = Trainer(logger=CSVLogger(tmp_path), enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(LightningModule())
    show_step(trainer, 120)
    assert trainer.global_step == 120
    source = inspect.getsource(_LoggerConnector.log_metrics)
    assert "step = self.trainer.fit_loop.epoch_loop._batches_that_stepped" in source
    trainer._logger_connector.log_metrics({"val/loss": 1.5})
    trainer.logger.save()
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[1].endswith(",120,1.5")


def test_save_step_and_replace_same_names(tmp_path):
    """save_step (through FinalStep) saves a run's last step as ModelCheckpoint saves a periodic one, once, and
    last.ckpt names it; replace_same_names makes a second run's same-named checkpoints replace the first's, with no
    `-v1` file. A real Trainer on Lightning's BoringModel, one process."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gpt_tp.checkpoint import FinalStep
    from gpt_tp.checkpoint import AtomicModelCheckpoint as Atomic

    def fit(steps: int) -> Atomic:
        cb = Atomic(dirpath=tmp_path, filename="step{step}", auto_insert_metric_name=False, every_n_train_steps=2,
                    save_top_k=-1, save_last="link")
        Trainer(max_steps=steps, callbacks=[cb, FinalStep()], logger=False, enable_progress_bar=False,
                enable_model_summary=False, limit_val_batches=0).fit(BoringModel())
        return cb

    cb = fit(3)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step2.ckpt", "step3.ckpt"]
    assert os.readlink(tmp_path / "last.ckpt") == "step3.ckpt" and cb.last_model_path == str(tmp_path / "last.ckpt")
    fit(4)  # step 4 is periodic and last: saved once
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step2.ckpt", "step3.ckpt", "step4.ckpt"]
    assert os.readlink(tmp_path / "last.ckpt") == "step4.ckpt"
