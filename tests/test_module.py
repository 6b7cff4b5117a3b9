"""GPTModule on one device, in-process: metrics, the non-finite stop, batch checks, the schedule on resume, fp16."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import MixedPrecision

from gpt_tp.errors import UserError
from gpt_tp.model import GPTConfig
from gpt_tp.train.module import GPTModule
from gpt_tp.train.optim import AdamW, get_lr
from synthetic_data import SyntheticDataModule


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
    assert m["train/lr"] > 6e-5 == get_lr(3, 1e-3, 6e-5, 1, 3)  # the last trained step, one short of min_lr (as build-nanogpt)
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


class LrRecord(Callback):
    """The learning rate each optimizer step used, by global step."""

    def __init__(self):
        self.lr = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lr[trainer.global_step - 1] = float(trainer.callback_metrics["train/lr"])


def test_run_as_long_as_its_warmup_trains_every_step():
    """max_steps == warmup_steps: every step warms up, the scheduler's step after the last one gets min_lr."""
    t = trainer(3, callbacks=[rec := LrRecord()])
    model = GPTModule("tiny", max_lr=1e-3, min_lr=1e-4, warmup_steps=3, max_steps=3, total_batch_size=None)
    t.fit(model, SyntheticDataModule(batch_size=2, seq_len=32))
    assert t.global_step == 3
    assert list(rec.lr.values()) == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    assert [g["lr"] for g in model.optimizers().param_groups] == pytest.approx([1e-3, 1e-3])  # the last step's


def test_resume_with_a_longer_schedule_uses_it_from_the_first_step(tmp_path):
    """A checkpoint saved at the end of a 4-step schedule, resumed with max_steps 8: step 4 is on the new cosine
    (max_lr at its start), not the saved run's min_lr; later steps too."""
    data = SyntheticDataModule(batch_size=2, seq_len=32)
    first = trainer(4)
    first.fit(GPTModule("tiny", max_lr=1e-3, min_lr=1e-4, warmup_steps=2, max_steps=4, total_batch_size=None), data)
    first.save_checkpoint(tmp_path / "end.ckpt")
    rec = LrRecord()
    second = trainer(8, callbacks=[rec])
    second.fit(GPTModule("tiny", max_lr=1e-3, min_lr=1e-4, warmup_steps=2, max_steps=8, total_batch_size=None), data, ckpt_path=tmp_path / "end.ckpt")
    assert sorted(rec.lr) == [4, 5, 6, 7]
    new = [get_lr(s, max_lr=1e-3, min_lr=1e-4, warmup_steps=2, max_steps=8) for s in range(4, 8)]
    assert [rec.lr[s] for s in range(4, 8)] == pytest.approx(new, rel=1e-6)
    assert get_lr(4, max_lr=1e-3, min_lr=1e-4, warmup_steps=2, max_steps=4) == 1e-4 != pytest.approx(new[0])


class ScaleRecord(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        weights = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.rows.append((scaler and scaler.get_scale(), float(m["train/loss"]), float(m["train/grad_norm"]), weights.clone()))


def _fp16_fit(steps, init_scale=None):
    """16-mixed with a GradScaler (Lightning turns '16-mixed' into bf16 on CPU; a plugin instance keeps fp16)."""
    L.seed_everything(3, verbose=False)
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale))] if init_scale else []
    t = trainer(steps, callbacks=[rec := ScaleRecord()], plugins=plugins)
    model = GPTModule(GPTConfig.from_name("tiny", vocab_size=1024), max_lr=3e-3, warmup_steps=1, max_steps=steps, total_batch_size=None)
    t.fit(model, SyntheticDataModule(batch_size=2, seq_len=32, vocab=1024))
    return t, rec.rows


def test_fp16_trains_with_its_gradient_scaler():
    """A step the scaler skips (scaled gradients overflow fp16) is no failure: the weights stay, the scale halves,
    and the next steps train. The clipped, logged norm is the unscaled one: fp16 follows fp32."""
    t, rows = _fp16_fit(6, init_scale=2.0**20)  # overflows for the first steps
    skipped = [i for i, r in enumerate(rows) if not math.isfinite(r[2])]
    assert skipped and skipped == list(range(len(skipped))) and len(skipped) < 5, [r[:3] for r in rows]
    for i in skipped[1:]:
        assert torch.equal(rows[i][3], rows[0][3]) and rows[i][0] == rows[i - 1][0] / 2
    assert not torch.equal(rows[-1][3], rows[0][3])  # the steps after the skips moved the weights
    assert t.optimizers[0].defaults["fused"] is False  # Lightning unscales before clipping only for non-fused AdamW
    _, fp32 = _fp16_fit(4)
    _, fp16 = _fp16_fit(4, init_scale=2.0**10)  # no overflow
    assert [r[2] for r in fp16] == pytest.approx([r[2] for r in fp32], rel=1e-3)  # measured: 2e-4
    assert [r[1] for r in fp16] == pytest.approx([r[1] for r in fp32], rel=1e-4)  # measured: 2e-5
    assert fp16[-1][1] < fp16[0][1] and fp32[-1][1] < fp32[0][1]


def test_fp16_refuses_fused_adamw():
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    with pytest.raises(UserError, match=r"model.optimizer.fused=true cannot train with trainer.precision=16-mixed.*bf16-mixed"):
        trainer(2, plugins=plugins).fit(GPTModule("tiny", optimizer=AdamW(fused=True), total_batch_size=None), SyntheticDataModule(batch_size=2, seq_len=32))


def test_the_schedule_is_the_trainers_length():
    """GPTModule in a script: max_steps left unset takes trainer.max_steps (the lr reaches the cosine's end there);
    another number than the trainer's is refused in one line rather than trained on a longer schedule."""
    t = trainer(4, callbacks=[rec := LrRecord()])
    model = GPTModule("tiny", max_lr=1e-3, min_lr=1e-4, warmup_steps=1, total_batch_size=None)
    t.fit(model, SyntheticDataModule(batch_size=2, seq_len=32))
    assert model.hparams.max_steps == 4
    assert [rec.lr[s] for s in range(4)] == pytest.approx([get_lr(s, 1e-3, 1e-4, 1, 4) for s in range(4)])
    with pytest.raises(UserError, match=r"model.max_steps=19073 but trainer.max_steps=10: one number"):
        trainer(10).fit(GPTModule("tiny", max_steps=19073, total_batch_size=None),
                        SyntheticDataModule(batch_size=2, seq_len=32))


class GroupRecord(Callback):
    """Each optimizer step's AdamW settings, group by group, as the optimizer is about to use them."""

    def __init__(self):
        self.groups = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.groups[trainer.global_step] = [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"])
                                            for g in optimizer.param_groups]


def test_resume_applies_the_optimizer_settings_it_is_given(tmp_path):
    """A resume with other betas, eps and weight decay trains with them, beside the saved moments: the groups hold
    them from the first resumed step, as the hparams record them (the no-decay group stays at 0)."""
    data = SyntheticDataModule(batch_size=2, seq_len=32)
    first = trainer(2)
    first.fit(GPTModule("tiny", max_lr=1e-3, warmup_steps=1, total_batch_size=None), data)
    first.save_checkpoint(tmp_path / "two.ckpt")
    second = trainer(4, callbacks=[rec := GroupRecord()])
    model = GPTModule("tiny", max_lr=2e-3, warmup_steps=1, optimizer=AdamW(weight_decay=0.0, betas=(0.5, 0.6), eps=1e-3),
                      total_batch_size=None)
    second.fit(model, data, ckpt_path=tmp_path / "two.ckpt")
    assert sorted(rec.groups) == [2, 3]
    for step, groups in rec.groups.items():
        lr = get_lr(step, 2e-3, 6e-5, 1, 4)
        assert groups == [(pytest.approx(lr), (0.5, 0.6), 1e-3, 0.0)] * 2, step
    assert model.hparams.optimizer == {"class_path": "gpt_tp.train.optim.AdamW", "init_args": {
        "weight_decay": 0.0, "betas": (0.5, 0.6), "eps": 1e-3, "fused": None}}
    assert all(s["step"] == 4 for s in model.optimizers().optimizer.state.values())  # the saved moments went on


def test_float32_matmul_precision_is_set_at_setup():
    """model.float32_matmul_precision: high (TF32 on CUDA) is torch's setting in the process that sets the module up."""
    from gpt_tp.train.run import resolve_run

    module = GPTModule("tiny", float32_matmul_precision="high")
    module.use_run(resolve_run(module.config, 1, 1))
    assert torch.get_float32_matmul_precision() == "highest"
    try:
        module.setup("validate")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")


class MetricsRecord(Logger):
    """Every value logged, by step and metric, in memory."""

    name, version = "record", 0

    def __init__(self):
        super().__init__()
        self.rows = {}

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        for k, v in metrics.items():  # every value: LearningRateMonitor logs at each micro-batch's start
            self.rows.setdefault(step, {}).setdefault(k, []).append(v)

    def log_hyperparams(self, *args, **kwargs):
        pass


def test_learning_rate_monitor_logs_the_steps_lr(tmp_path):
    """LearningRateMonitor (reading the optimizer at on_train_batch_start) logs each step's own lr, equal to train/lr
    and the schedule's, from the first step and from the first resumed step, with gradient accumulation."""
    data = SyntheticDataModule(batch_size=2, seq_len=32)
    for steps, ckpt in ((3, None), (6, tmp_path / "three.ckpt")):
        t = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=(logger := MetricsRecord()),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, log_every_n_steps=1, accumulate_grad_batches=2, inference_mode=False,
                      callbacks=[LearningRateMonitor(logging_interval="step")])
        t.fit(GPTModule("tiny", max_lr=1e-3, warmup_steps=2, total_batch_size=None), data, ckpt_path=ckpt)
        t.save_checkpoint(tmp_path / "three.ckpt")
        monitored = {s: r["lr-AdamW/pg1"] + r["lr-AdamW/pg2"] for s, r in logger.rows.items() if "lr-AdamW/pg1" in r}
        logged = {s: r["train/lr"] for s, r in logger.rows.items() if "train/lr" in r}
        first = 0 if ckpt is None else 3
        assert sorted(monitored) == sorted(logged) == list(range(first, steps))
        for s in monitored:  # each micro-batch's value, both groups (decay, no decay)
            assert monitored[s] == [pytest.approx(get_lr(s, 1e-3, 6e-5, 2, steps))] * 4, s
            assert logged[s] == [pytest.approx(monitored[s][0])], s


def test_the_progress_bar_prints_its_last_line_once(capsys):
    """StepProgressBar (cli.py's) with a validation at the last step: the final `4/4` line is printed once (the bar's
    close), with that step's loss, val loss and lr; the steps before it once each as they come."""
    from gpt_tp.train.progress import StepProgressBar

    t = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                  enable_model_summary=False, limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0,
                  log_every_n_steps=1, inference_mode=False, callbacks=[StepProgressBar()])
    capsys.readouterr()
    t.fit(GPTModule("tiny", max_lr=1e-3, warmup_steps=1, total_batch_size=None), SyntheticDataModule(batch_size=2, seq_len=32))
    out = capsys.readouterr().out
    assert out.count("| 4/4 [") == 1 and out.count("| 3/4 [") == 1, out[-2000:]
    last = out[out.index("| 4/4 ["):]
    assert "val/loss=" in last and f"lr={get_lr(3, 1e-3, 6e-5, 1, 4):.2e}" in last
