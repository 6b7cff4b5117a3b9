"""The training progress bar in optimizer steps, N/max_steps, with the step's loss, tokens/s and learning rate
(docs/train.md); it replaces Lightning's default bar, rich or not. The stream is endless: no epoch count."""

from lightning.pytorch.callbacks import TQDMProgressBar


class StepProgressBar(TQDMProgressBar):
    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]{postfix}"

    def on_train_epoch_start(self, trainer, *_) -> None:
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        bar.initial = trainer.global_step  # a resumed run starts where it stopped; the rate counts this run only
        bar.n = trainer.global_step
        bar.unit = "step"
        bar.set_description("train")
        bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if bar is None or step == bar.n:  # inside an accumulation window: no optimizer step yet
            return
        if self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = {k: v for k, v in super().get_metrics(trainer, pl_module).items() if k != "v_num"}
        if trainer.optimizers:
            metrics["lr"] = f"{trainer.optimizers[0].param_groups[0]['lr']:.2e}"
        return metrics
