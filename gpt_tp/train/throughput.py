"""StepThroughput: tokens/s and MFU per optimizer step (GPTModule.configure_callbacks adds it), not Lightning's
ThroughputMonitor (docs/train.md says why). No sync of its own: GPTModule reads the loss to the host once a step."""

import math
import time

import torch
from lightning.pytorch.callbacks import Callback

from gpt_tp.hardware import GIB, detect_peak_flops, mfu
from gpt_tp.ranks import layout_of


class StepThroughput(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self._step, self._t, self._tokens = trainer.global_step, None, 0
        self._peak = pl_module.hparams.peak_flops or detect_peak_flops(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x = batch[0]  # (B, T) token ids
        if self._t is None:
            self._t = time.perf_counter()
        self._tokens += x.numel()
        self._seq_len = x.shape[1]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step:  # inside an accumulation window
            return
        now = time.perf_counter()
        tok_s = self._tokens * layout_of(trainer).dp / (now - self._t)
        step_mfu = mfu(pl_module.config.flops_per_token(self._seq_len), tok_s, self._peak, trainer.world_size)
        logged = {"train/tokens_per_sec": tok_s, "train/mfu": math.nan if step_mfu is None else step_mfu}
        if pl_module.device.type == "cuda":  # rank 0's high-water mark so far
            logged["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / GIB
        pl_module.log_dict(logged, on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log("tok/s", tok_s, prog_bar=True, logger=False, on_step=True, rank_zero_only=True)
        self._step, self._t, self._tokens = trainer.global_step, now, 0
