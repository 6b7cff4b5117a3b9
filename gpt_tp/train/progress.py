"""The training progress bar in optimizer steps, N/max_steps, with the step's loss, tokens/s and learning rate
(docs/train.md); it replaces Lightning's default bar, rich or not. The stream is endless: no epoch count."""

from lightning.pytorch.callbacks import ModelSummary, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class StepProgressBar(TQDMProgressBar):
    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]{postfix}"
    train_description = "train"

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.on_train_epoch_start(trainer)  # a run resumed mid-epoch (from a periodic save) gets no epoch start

    def on_train_epoch_start(self, trainer, *_) -> None:
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        bar.initial = bar.n = trainer.global_step  # a resumed run starts where it stopped; the rate counts this run
        bar.unit = "step"
        bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        # every refresh_rate optimizer steps and the last one; not mid-accumulation (the step has not moved)
        if bar is not None and self.is_enabled and step != bar.n and (step % self.refresh_rate == 0 or step == bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            if step != bar.total:  # the last step's line: printed once, by the bar's close at the end of training
                bar.refresh()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and trainer.global_step == trainer.max_steps:  # no line of its own at the end
            return self.val_progress_bar.close()
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = {k: v for k, v in super().get_metrics(trainer, pl_module).items() if k != "v_num"}
        if trainer.optimizers:
            metrics["lr"] = f"{trainer.optimizers[0].param_groups[0]['lr']:.2e}"
        return metrics


class GPTSummary(ModelSummary):
    """The model summary in one line, its training FLOPs per token from GPTConfig.flops_per_token (as MFU): Lightning's
    table needs an example forward for its FLOPs, which a TP model cannot run on rank 0 alone, and reads 0 without."""

    def on_fit_start(self, trainer, pl_module) -> None:
        c = pl_module.config
        T = getattr(trainer.datamodule, "seq_len", None) or c.block_size
        rank_zero_info(f"model: {c.n_layer} layers x {c.n_head} heads, n_embd={c.n_embd}, vocab {c.vocab_size}, "
                       f"{c.num_params(non_embedding=False) / 1e6:.1f}M parameters; {c.flops_per_token(T):.3g} "
                       f"training FLOPs per token at T={T}")
