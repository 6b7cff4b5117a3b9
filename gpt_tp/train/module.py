"""The LightningModule: GPT-2 trained the build-nanogpt way, tensor-parallel under ModelParallelStrategy."""

import dataclasses
import math
import time
from contextlib import nullcontext

import lightning as L
import torch

from gpt_tp.errors import UserError
from gpt_tp.hardware import GIB, detect_peak_flops, mfu
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.model import GPT, GPTConfig, load_hf_dir
from gpt_tp.train.optim import AdamW, Muon, Schedule, optimizer_from
from gpt_tp.parallel import TP_PLAN, check_ac_mode, materialize, parallelize
from gpt_tp.ranks import layout_of
from gpt_tp.infer.predict import continue_prompt
from gpt_tp.train.rng import RNGStates
from gpt_tp.train.run import Run, resolve_run
from gpt_tp.train.step import TrainStep


class GPTModule(L.LightningModule):
    tp_plan = TP_PLAN  # the plan configure_model applies; benchmarks/plans.py subclasses name the reference plans

    def __init__(self, model: str | GPTConfig = "gpt2", max_lr: float = 6e-4, min_lr: float = 6e-5,
                 warmup_steps: int = 715, max_steps: int | None = None, optimizer: AdamW = AdamW(),
                 total_batch_size: int | None = 524288, compile: bool = False,
                 meta_init: bool = False, init_from: str | None = None, peak_flops: float | None = None,
                 activation_checkpointing: str = "none", float32_matmul_precision: str | None = None):
        """
        Args:
            model: a named size (gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny) or the GPTConfig fields.
            max_lr, min_lr, warmup_steps, max_steps: the warmup + cosine schedule, per optimizer step; max_steps is
                trainer.max_steps (None: taken from the trainer; another number is refused).
            optimizer: AdamW (build-nanogpt's, the default) or Muon on the blocks' 2-D weights with AdamW on the
                rest, with their fields (gpt_tp.train.optim): --model.optimizer Muon --model.optimizer.lr 0.02.
            total_batch_size: tokens per optimizer step, to equal batch_size x seq_len x DP x accumulation; None: any.
            compile: torch.compile each block (after TP, before FSDP2).
            meta_init: build on the meta device, initialise only the local shards (the same numbers as on one device).
            init_from: a local Hugging Face GPT-2 directory (config.json + model.safetensors) to start from.
            peak_flops: the device's peak FLOP/s for MFU; None detects known GPUs (MFU is NaN on CPU).
            activation_checkpointing: per block, "none", "full" (recompute the block in backward) or "selective" (keep
                matmul and attention outputs); the same losses and gradients in every mode.
            float32_matmul_precision: torch.set_float32_matmul_precision in every process: "high" runs 32-true's
                float32 matmuls as TF32 on CUDA GPUs; None leaves torch's default ("highest").
        """
        super().__init__()
        check_ac_mode(activation_checkpointing)
        Schedule(max_lr, min_lr, warmup_steps, 1 if max_steps is None else max_steps)  # checked when made
        if peak_flops is not None and not peak_flops > 0:
            raise UserError(f"model.peak_flops={peak_flops} must be > 0 (the device's peak FLOP/s), or null to detect it")
        if float32_matmul_precision not in (None, "highest", "high", "medium"):
            raise UserError(f"model.float32_matmul_precision={float32_matmul_precision}: use highest, high (TF32 on "
                            "CUDA) or medium")
        optimizer = optimizer_from(optimizer).hparam()  # hparams as plain data: checkpoints load with weights_only
        self.save_hyperparameters()
        self.config, hf_state = GPTConfig.resolve(model), None  # a checkpoint's hparams hold the fields as a dict
        if init_from is not None:
            self.config, hf_state = load_hf_dir(init_from, vocab_size=self.config.vocab_size)
        if init_from is not None or not isinstance(model, str):
            # the model built (init_from's shape, vocab mask), plain for weights_only loads; export uses it
            self.hparams["model"] = dataclasses.asdict(self.config)
        with torch.device("meta") if meta_init and hf_state is None else nullcontext():
            self.model = GPT(self.config)
        if hf_state is not None:
            self.model.load_state_dict(hf_state)
        self.step_fn: TrainStep | None = None  # the training step, made with the optimizer
        self.run: Run | None = None  # the resolved run: cli.py's (use_run), or resolved from the trainer at setup

    def use_run(self, run: Run) -> None:
        """The run as cli.py resolved and checked it before launch: setup then resolves nothing again."""
        self.run = run

    def setup(self, stage: str) -> None:
        """A script's GPTModule and Trainer go through cli.py's resolve and checks (once); the schedule's length is
        the trainer's: model.max_steps is trainer.max_steps, or None to take it."""
        if self.hparams.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.hparams.float32_matmul_precision)
        if self.run is None:
            layout, data, h, fit = layout_of(self.trainer, self), self.trainer.datamodule, self.hparams, stage == "fit"
            batch, total = (getattr(data, "batch_size", None), h.total_batch_size) if fit else (None, None)
            self.run = resolve_run(self.config, layout.dp, layout.tp, str(self.trainer.precision),
                                   h.activation_checkpointing, h.compile, getattr(data, "seq_len", None), batch,
                                   self.trainer.accumulate_grad_batches, total, world_size=self.trainer.world_size)
        if stage != "fit":
            return
        steps, own = self.trainer.max_steps, self.hparams.max_steps
        if own is not None and own != steps:
            raise UserError(f"model.max_steps={own} but trainer.max_steps={steps}: one number is the run's length and "
                            "its learning-rate schedule's; leave model.max_steps unset (None) or equal")
        Schedule(max_steps=steps)  # refuses trainer.max_steps < 1 (model.max_steps >= 1 was checked at init)
        self.hparams.max_steps = steps  # recorded in hparams.yaml and checkpoints as trained

    def configure_model(self) -> None:
        run = self.run
        param_dtype = torch.bfloat16 if run.precision == "bf16-mixed" else None  # FSDP2's gathers
        parallelize(self.model, self.device_mesh, compile=run.compile, param_dtype=param_dtype,
                    activation_checkpointing=run.activation_checkpointing, plan=self.tp_plan)
        materialize(self.model, self.device)

    def configure_optimizers(self):
        """The training step's optimizer. No lr scheduler: each step sets its own lr (and the optimizer's other
        settings) from these hparams (TrainStep.begin), on a fresh or a resumed optimizer alike."""
        h, optimizer = self.hparams, optimizer_from(self.hparams.optimizer)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # 16-mixed's gradient scaler
        fp16 = scaler is not None and scaler.is_enabled()
        if fp16 and isinstance(optimizer, Muon):
            raise UserError("model.optimizer=Muon does not train with trainer.precision=16-mixed (its gradient "
                            "scaler is not supported); use trainer.precision=bf16-mixed or 32-true")
        if fp16 and optimizer.fused:  # never fused under fp16: Lightning would clip a fused AdamW's scaled gradients
            raise UserError("model.optimizer.fused=true cannot train with trainer.precision=16-mixed: the gradients "
                            "would be clipped before the gradient scaler unscales them; set model.optimizer.fused=null, "
                            "or use trainer.precision=bf16-mixed")
        optimizer = dataclasses.replace(optimizer, fused=False) if fp16 else optimizer
        schedule = Schedule(h.max_lr, h.min_lr, h.warmup_steps, h.max_steps)
        self.step_fn = TrainStep(self.model, optimizer, schedule, loss_fn=self.compute_loss, fp16=fp16)
        return self.step_fn.optimizer

    def configure_callbacks(self) -> list:
        """What every run needs, whatever the trainer's callbacks: RNG states in checkpoints, tokens/s and MFU."""
        return [RNGStates(), StepThroughput()]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    # The step (gpt_tp/train/step.py draws it in order): each hook hands over to its phase of TrainStep.
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.run.batch_size is None:  # a data module without batch_size and seq_len: its first batch tells them
            run = self.run
            self.run = resolve_run(run.model, run.dp, run.tp, run.precision, run.activation_checkpointing, run.compile,
                                   x.shape[1], x.shape[0], run.accumulate, run.total_batch_size)
        # Lightning's accumulation rule (its batch_idx restored on resume): the last micro-batch syncs the gradients
        self._last_micro_batch = (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0
        return self.step_fn.loss(x, y, self._last_micro_batch if self.run.sync_once else None)

    def on_train_start(self) -> None:  # the coming step's lr, set before Lightning's callbacks read it
        self.step_fn.begin(self.global_step)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # after the last step: that step's lr kept
        self.step_fn.begin(min(self.global_step, self.trainer.max_steps - 1))

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        loss.backward(*args, **kwargs)
        if self._last_micro_batch:
            self.step_fn.sync()

    def on_before_optimizer_step(self, optimizer) -> None:
        shares = [(cb, cb.step_flags(self.trainer)) for cb in self.trainer.callbacks if hasattr(cb, "step_flags")]
        loss, norm, sums = self.step_fn.check(self.global_step, self.trainer.accumulate_grad_batches,
                                              [f for _, flags in shares for f in flags])
        for cb, flags in shares:
            cb.flags_summed(self.trainer, [sums.pop(0) for _ in flags])
        self.log_dict({"train/loss": loss, "train/lr": optimizer.param_groups[0]["lr"], "train/grad_norm": norm},
                      on_step=True, on_epoch=False, rank_zero_only=True)
        self.log("loss", loss, prog_bar=True, logger=False, on_step=True, rank_zero_only=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if gradient_clip_algorithm not in (None, "norm"):
            raise UserError("gpt_tp clips by norm only: set trainer.gradient_clip_algorithm=norm")
        self.step_fn.clip(gradient_clip_val)

    def compute_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, y)

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        return continue_prompt(self, batch)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = cross_entropy(self.model(x), y)
        # sync_dist averages over all ranks: TP ranks hold equal copies, so this is the mean over DP ranks
        self.log("val/loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)


class StepThroughput(L.Callback):
    """Tokens/s and MFU per optimizer step (GPTModule.configure_callbacks adds it), not Lightning's ThroughputMonitor
    (docs/train.md says why). No sync of its own: GPTModule reads the loss to the host once a step."""

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
