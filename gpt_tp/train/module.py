"""The LightningModule: GPT-2 trained the build-nanogpt way, tensor-parallel under ModelParallelStrategy."""

import dataclasses
import math
from contextlib import nullcontext

import lightning as L
import torch

from gpt_tp.errors import UserError
from gpt_tp.hardware import check_peak_flops
from gpt_tp.parallel.loss import cross_entropy
from gpt_tp.model import GPT, GPTConfig, load_hf_dir
from gpt_tp.train.optim import check_muon, check_optimizer, fused_with_scaler, get_lr, make_optimizer
from gpt_tp.parallel import TP_PLAN, check_ac_mode, clip_grad_norm, enable_async_tp, grad_norm, materialize, parallelize
from gpt_tp.sizing import check_run
from gpt_tp.train.ranks import parallel_layout
from gpt_tp.train.predict import continue_prompt
from gpt_tp.train.rng import RNGStates
from gpt_tp.train.throughput import StepThroughput


class GPTModule(L.LightningModule):
    tp_plan = TP_PLAN  # the plan configure_model applies; benchmarks/plans.py subclasses name the reference plans

    def __init__(self, model: str | GPTConfig = "gpt2", max_lr: float = 6e-4, min_lr: float = 6e-5,
                 warmup_steps: int = 715, max_steps: int = 19073, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, fused: bool | None = None,
                 total_batch_size: int | None = 524288, compile: bool = False, async_tp: bool = False,
                 meta_init: bool = False, init_from: str | None = None, peak_flops: float | None = None,
                 activation_checkpointing: str = "none", optimizer: str = "adamw", muon_lr: float = 0.02,
                 muon_fp32: bool = False):
        """
        Args:
            model: a named size (gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny) or the GPTConfig fields.
            max_lr, min_lr, warmup_steps, max_steps: the warmup + cosine schedule, per optimizer step (cli.py sets
                max_steps from trainer.max_steps).
            weight_decay: applied to >= 2-D parameters only.
            betas, eps: AdamW's.
            fused: fused AdamW; None picks it where the device has it, except under 16-mixed (where true is refused).
            total_batch_size: tokens per optimizer step, to equal batch_size x seq_len x DP x accumulation; None: any.
            compile: torch.compile each block (after TP, before FSDP2).
            async_tp: overlap TP collectives with the matmuls (Inductor micro-pipelining); CUDA, TP > 1, compile only.
            meta_init: build on the meta device, initialise only the local shards (the same numbers as on one device).
            init_from: a local Hugging Face GPT-2 directory (config.json + model.safetensors) to start from.
            peak_flops: the device's peak FLOP/s for MFU; None detects known GPUs (MFU is NaN on CPU).
            activation_checkpointing: per block, "none", "full" (recompute the block in backward) or "selective" (keep
                matmul and attention outputs); the same losses and gradients in every mode.
            optimizer: "adamw" (build-nanogpt's), or "muon": torch.optim.Muon's update on the blocks' 2-D weights
                (c_attn, attn.c_proj, c_fc, mlp.c_proj), sharded (gpt_tp.parallel.muon), AdamW on the rest.
            muon_lr: Muon's peak lr, on the same warmup + cosine multiplier as max_lr.
            muon_fp32: Newton-Schulz in float32 instead of torch.optim.Muon's bfloat16 (for parity tests).
        """
        super().__init__()
        check_ac_mode(activation_checkpointing)
        check_optimizer(max_lr, min_lr, warmup_steps, max_steps, weight_decay, betas, eps)
        check_muon(optimizer, muon_lr)
        check_peak_flops(peak_flops)
        self.save_hyperparameters()
        self.config = GPTConfig.resolve(model)  # a checkpoint's hyper-parameters hold the fields as a dict
        hf_state = None
        if init_from is not None:
            self.config, hf_state = load_hf_dir(init_from, vocab_size=self.config.vocab_size)
        if init_from is not None or not isinstance(model, str):
            # the model built (init_from's shape, vocab mask), plain for weights_only loads; export/HellaSwag use it
            self.hparams["model"] = dataclasses.asdict(self.config)
        with torch.device("meta") if meta_init and hf_state is None else nullcontext():
            self.model = GPT(self.config)
        if hf_state is not None:
            self.model.load_state_dict(hf_state)
        self._batch_checked = False
        self._loss_sum = None  # sum of micro-batch losses since the last optimizer step

    def configure_model(self) -> None:
        if self.hparams.async_tp:  # before the first compiled forward
            if not self.hparams.compile:
                raise UserError("model.async_tp needs model.compile: true (it is an Inductor pass)")
            if self.device_mesh is None:
                raise UserError("model.async_tp needs a tensor-parallel run (ModelParallelStrategy, TP > 1)")
            enable_async_tp(self.device_mesh["tensor_parallel"])
        param_dtype = torch.bfloat16 if str(self.trainer.precision) == "bf16-mixed" else None  # FSDP2's gathers
        parallelize(self.model, self.device_mesh, compile=self.hparams.compile, param_dtype=param_dtype,
                    activation_checkpointing=self.hparams.activation_checkpointing, plan=self.tp_plan)
        materialize(self.model, self.device)

    def _lr(self, step: int) -> float:
        h = self.hparams
        return get_lr(step, h.max_lr, h.min_lr, h.warmup_steps, h.max_steps)

    def _grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 (16-mixed)'s gradient scaler; None in every other precision."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def configure_optimizers(self):
        h = self.hparams
        fp16 = self._grad_scaler() is not None
        if fp16 and h.optimizer == "muon":
            raise UserError("model.optimizer=muon does not train with trainer.precision=16-mixed (its gradient "
                            "scaler is not supported); use trainer.precision=bf16-mixed or 32-true")
        opt = make_optimizer(self.model, h.optimizer, h.max_lr, h.weight_decay, tuple(h.betas), h.eps,
                             fused_with_scaler(h.fused, fp16), h.muon_lr,
                             torch.float32 if h.muon_fp32 else torch.bfloat16)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: self._lr(step) / h.max_lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        """Put the optimizer on this run's schedule: a resumed optimizer and LambdaLR hold the saved run's lr and
        base_lrs, so the first step would follow the old schedule (its min_lr, once it had ended). Each group's peak:
        muon_lr for Muon's, max_lr for AdamW's."""
        sched, h = self.lr_schedulers(), self.hparams
        sched.base_lrs = [h.muon_lr if g.get("muon") else h.max_lr for g in sched.optimizer.param_groups]
        for group, peak in zip(sched.optimizer.param_groups, sched.base_lrs):
            group["lr"] = peak * self._lr(self.global_step) / h.max_lr

    def configure_callbacks(self) -> list:
        """What every run needs, whatever the trainer's callbacks: RNG states in checkpoints, tokens/s and MFU."""
        return [RNGStates(), StepThroughput()]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not self._batch_checked:  # for runs that bypass cli.py, which checks the same before launch
            tp, _, dp, _ = parallel_layout(self.trainer, self)
            check_run(self.config, tp, dp, x.shape[1], x.shape[0], self.trainer.accumulate_grad_batches,
                      self.hparams.total_batch_size)
            self._batch_checked = True
        loss = self.compute_loss(self.model(x), y)  # the logits go as soon as the loss is taken
        self._loss_sum = loss.detach() if self._loss_sum is None else self._loss_sum + loss.detach()
        return loss

    def compute_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, y)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Per optimizer step: the global grad norm, the DP-mean loss, their finite check (before the step, a save)."""
        self._grad_norm = grad_norm(self.model)
        loss = self._loss_sum / self.trainer.accumulate_grad_batches
        self._loss_sum = None
        _, _, dp, group = parallel_layout(self.trainer, self)
        if dp > 1:
            torch.distributed.all_reduce(loss, group=group)  # in place: `loss` is this step's own tensor
            loss = loss / dp
        loss, norm = torch.stack([loss, self._grad_norm.float()]).tolist()  # the step's one host sync
        # fp16: an inf norm is the scaler's overflow: it skips the step, lowers its scale; a non-finite loss fails
        if not (math.isfinite(loss) and (math.isfinite(norm) or self._grad_scaler() is not None)):
            raise RuntimeError(f"non-finite training at step {self.global_step}: loss={loss}, grad_norm={norm}. The "
                               "run is stopped so no checkpoint holds NaNs; resume from the last good checkpoint "
                               "with a lower model.max_lr, check the data, or use bf16 rather than fp16 precision.")
        self.log_dict({"train/loss": loss, "train/lr": optimizer.param_groups[0]["lr"], "train/grad_norm": norm},
                      on_step=True, on_epoch=False, rank_zero_only=True)
        self.log("loss", loss, prog_bar=True, logger=False, on_step=True, rank_zero_only=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clipping at trainer.gradient_clip_val, by the norm on_before_optimizer_step took."""
        if gradient_clip_algorithm not in (None, "norm"):
            raise UserError("gpt_tp clips by norm only: set trainer.gradient_clip_algorithm=norm")
        clip_grad_norm(self.model, gradient_clip_val, self._grad_norm)

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        return continue_prompt(self, batch)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = cross_entropy(self.model(x), y)
        # sync_dist averages over all ranks: TP ranks hold equal copies, so this is the mean over DP ranks
        self.log("val/loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss
