"""StopAt: ends a fit after `step` optimizer steps, as a preemption would, leaving trainer.max_steps (the run's length
and its schedule's) as it is."""

from lightning.pytorch.callbacks import Callback


class StopAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True
