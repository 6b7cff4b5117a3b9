"""GPTModule on one device, in-process: metrics, the non-finite stop, batch checks."""

import math

import lightning as L
import pytest

from gpt_tp.module import GPTModule
from gpt_tp.optim import get_lr
from gpt_tp.synthetic import SyntheticDataModule


def trainer(steps, **kw):
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=2, val_check_interval=steps, log_every_n_steps=1,
        gradient_clip_val=1.0, inference_mode=False, **kw,
    )


def test_metrics_are_logged_with_the_same_keys():
    t = trainer(3)
    model = GPTModule("tiny", max_lr=1e-3, warmup_steps=1, max_steps=3, total_batch_size=None, peak_flops=1e12)
    t.fit(model, SyntheticDataModule(batch_size=2, seq_len=32))
    m = {k: float(v) for k, v in t.callback_metrics.items()}
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu", "val/loss"):
        assert key in m and math.isfinite(m[key]), key
    assert m["train/lr"] == pytest.approx(get_lr(2, max_lr=1e-3, min_lr=6e-5, warmup_steps=1, max_steps=3))  # the 3rd step's
    tokens_per_step = 2 * 32
    assert m["train/mfu"] == pytest.approx(model.config.flops_per_token(32) * m["train/tokens_per_sec"] / 1e12, rel=1e-4)
    assert m["train/tokens_per_sec"] > tokens_per_step / 60  # a step of 64 tokens took under a minute


def test_non_finite_loss_stops_the_run():
    t = trainer(50)
    model = GPTModule("tiny", max_lr=1e4, min_lr=1e4, warmup_steps=0, max_steps=50, total_batch_size=None)
    with pytest.raises(RuntimeError, match=r"non-finite training at step \d+: loss=.*lower model.max_lr"):
        t.fit(model, SyntheticDataModule(batch_size=2, seq_len=32))
    assert t.global_step < 50


def test_total_batch_size_checked_at_first_step():
    t = trainer(2, accumulate_grad_batches=2)
    model = GPTModule("tiny", total_batch_size=1024)
    with pytest.raises(ValueError, match=r"data.batch_size=2 x data.seq_len=32 x data-parallel size 1 x trainer.accumulate_grad_batches=2 = 128: set trainer.accumulate_grad_batches=16"):
        t.fit(model, SyntheticDataModule(batch_size=2, seq_len=32))
    assert t.global_step == 0
