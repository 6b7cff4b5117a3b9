"""One-device fit of the tiny GPT, logging every step to a CSVLogger, killed with SIGKILL inside step --kill-at: what a
process ended by torchrun, Slurm or the OOM killer leaves behind."""

import argparse
import os
import signal

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from gpt_tp.train.module import GPTModule
from synthetic_data import SyntheticDataModule


class KillAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_after_backward(self, trainer, pl_module):  # inside step `step`
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", required=True)
    ap.add_argument("--kill-at", type=int, default=5)
    args = ap.parse_args()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2 * args.kill_at, logger=CSVLogger(args.logs, name="run"), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        gradient_clip_val=1.0, inference_mode=False, callbacks=[KillAt(args.kill_at)],
    )
    L.seed_everything(0, verbose=False)
    trainer.fit(GPTModule("tiny", warmup_steps=2, max_steps=2 * args.kill_at, total_batch_size=None), SyntheticDataModule(batch_size=2, seq_len=32))


if __name__ == "__main__":
    main()
