"""gpt_tp command line: `python cli.py fit --config configs/tp2.yaml` (see README)."""

import importlib.util
import os
import sys

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import ModelParallelStrategy

from gpt_tp.data import GPTDataModule
from gpt_tp.model import GPTConfig
from gpt_tp.module import GPTModule, check_total_batch
from gpt_tp.parallel import LayoutError, validate_layout
from gpt_tp.planner import detect_device_memory_gib, resolve_layout


def default_loggers(save_dir: str = "logs") -> list:
    """CSV always; TensorBoard too where it is installed."""
    loggers = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": save_dir, "name": "gpt_tp"}}]
    if importlib.util.find_spec("tensorboard"):  # its own folder, so both number their versions alike
        tb_dir = f"{save_dir}/tensorboard"
        loggers.append({"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": tb_dir, "name": "gpt_tp"}})
    return loggers


def model_config(cfg) -> GPTConfig:
    return GPTConfig.resolve(cfg.model.model)


class GPTCLI(LightningCLI):
    def before_instantiate_classes(self) -> None:
        """`auto` data/tensor-parallel sizes: the planner picks the smallest TP that fits the device memory."""
        cfg = self.config.get(self.subcommand) if self.subcommand else self.config
        init = getattr(cfg.trainer.strategy, "init_args", None) if cfg is not None else None
        if init is None or "auto" not in (init.get("data_parallel_size"), init.get("tensor_parallel_size")):
            return
        devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
        if not isinstance(devices, int):
            raise LayoutError(f"trainer.devices={devices!r}: give a number of devices per node to plan an 'auto' layout")
        dp, tp = resolve_layout(
            model_config(cfg), devices * nodes, devices, nodes, cfg.data.batch_size, cfg.data.seq_len,
            detect_device_memory_gib(), str(cfg.trainer.precision), dp=init.data_parallel_size, tp=init.tensor_parallel_size,
        )
        init.data_parallel_size, init.tensor_parallel_size = dp, tp
        print(f"gpt_tp planner: DP={dp} x TP={tp} (python -m gpt_tp.planner shows the table)", file=sys.stderr)

    def before_fit(self) -> None:
        """Check the layout and the batch arithmetic in every process before any process group or model exists."""
        if self.trainer.num_devices > 1 and isinstance(self.trainer.accelerator, CPUAccelerator) and "OMP_NUM_THREADS" not in os.environ:
            # N processes on one CPU each default to every core: oversubscribed, mostly waiting. torchrun does the same.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.trainer.num_devices))
        cfg = self.config[self.subcommand]
        world = self.trainer.num_devices * self.trainer.num_nodes
        dp, tp = world, 1  # DDP-like strategies
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            args = cfg.trainer.strategy.init_args  # numbers by now (before_instantiate_classes plans 'auto')
            dp, tp = int(args.data_parallel_size), int(args.tensor_parallel_size)
        validate_layout(model_config(cfg), tp=tp, dp=dp, world_size=world, seq_len=cfg.data.seq_len)
        check_total_batch(cfg.model.total_batch_size, cfg.data.batch_size, cfg.data.seq_len, dp, self.trainer.accumulate_grad_batches)


def main(args=None) -> GPTCLI:
    return GPTCLI(
        GPTModule,
        GPTDataModule,
        trainer_defaults={
            "logger": default_loggers(),
            "inference_mode": False,  # DTensors do not support inference_mode on GPUs
            "gradient_clip_val": 1.0,
        },
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # GPTModule.configure_optimizers: AdamW + warmup/cosine
        args=args,
    )


if __name__ == "__main__":
    main()
