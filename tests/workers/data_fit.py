"""Fit the tiny GPT on --data-dir (one process, or under torchrun with ModelParallelStrategy) for --steps steps;
``fit`` runs it in the caller's process.

Each rank touches <marks>/trained_rank<r> when its first training batch starts, so a test can see whether any
rank trained. Ends through gpt_tp.entry.run: a DataError prints one `error:` line per run and exits 2.
"""

import argparse
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from gpt_tp.train.datamodule import GPTDataModule
from gpt_tp.entry import run
from gpt_tp.model import GPTConfig
from gpt_tp.train.module import GPTModule


class MarkTraining(Callback):
    def __init__(self, marks: str):
        self.marks = Path(marks)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        (self.marks / f"trained_rank{trainer.global_rank}").touch()


def fit(data_dir, marks, tp: int = 1, dp: int = 1, steps: int = 2) -> None:
    world = tp * dp
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp) if world > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, inference_mode=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[MarkTraining(marks)])
    L.seed_everything(1234, verbose=False)
    model = GPTModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32), max_lr=1e-3, min_lr=1e-4,
                      warmup_steps=1, max_steps=steps, total_batch_size=None)
    trainer.fit(model, GPTDataModule(data_dir, batch_size=2, seq_len=32, val_batches=2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--marks", required=True)
    args = ap.parse_args()
    fit(args.data_dir, args.marks, args.tp, args.dp, args.steps)


if __name__ == "__main__":
    run(main)
