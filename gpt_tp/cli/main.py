"""cli.py: GPTCLI, TrainingCLI with its checks (and `auto` layouts planned) in the launching process: errors once."""

import contextlib
import dataclasses
import glob
import logging
import os
import shutil
import sys
import threading
import warnings

import torch
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from gpt_tp.data.shards import find_shards
from gpt_tp.errors import UserError
from gpt_tp.hardware import GIB, detect_device_memory_gib
from gpt_tp.model import GPTConfig
from gpt_tp.sizing import LayoutError, resolve_layout
from gpt_tp.sizing.memory import USABLE_FRACTION
from gpt_tp.sizing.sizes import checkpoint_bytes
from gpt_tp.checkpoint.last import FinalStep, checkpoints_line, relink_last
from gpt_tp.checkpoint.store import check_checkpoint, human_bytes, recover_interrupted_saves
from gpt_tp.cli.config import TrainingCLI, built_config, check_config, device_count, parallel_sizes
from gpt_tp.cli.lifecycle import (CKPT_ALIASES, callbacks_replaced_by, check_launch, check_not_complete, check_unused,
                                    remove_checkpoints, resume_checkpoint, saved_state)
from gpt_tp.train.logs import CheckpointStep, LogWriteCheck, RunLineage, quiet_writer_threads
from gpt_tp.train.optim import Schedule, get_lr, optimizer_from
from gpt_tp.infer.predict import PromptWriter
from gpt_tp.train.progress import GPTSummary, StepProgressBar
from gpt_tp.train.run import Run, layout_flags, resolve_run
from gpt_tp.cli.simulate import format_simulation, simulate
from gpt_tp.cluster.slurm import Preemption

SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size")  # what a Hugging Face folder's config.json decides
# Lightning's info lines that say nothing about a gpt_tp run, or that the closing line says instead
QUIET_INFO = ("💡 Tip: For seamless cloud", "`Trainer.fit` stopped:",
              "Trainer already configured with model summary callbacks")  # the last: GPTSummary, added below


def quiet_lightning() -> None:
    """Silence Lightning's lines a gpt_tp user can do nothing about; every rank runs this (main)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not record.getMessage().startswith(QUIET_INFO))
    threading.excepthook = quiet_writer_threads(threading.excepthook)  # TensorBoard's thread: its error comes back
    # Lightning 2.6's own pytree code on torch 2.13, once per rank
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # predict's prompts are a plain iterable on purpose (every rank runs every prompt): no batch indices to infer
    warnings.filterwarnings("ignore", message="Couldn't infer the batch indices fetched from your dataloader: `PromptBatches`")


def make_writable(folder: str, what: str, flag: str, fix: str) -> None:
    """Create `folder` before any rank starts: not a failure on rank 0 alone while the others wait in a collective."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag}: cannot create the {what} {folder} ({e.strerror}); set {fix} to a writable "
                        "folder") from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag}: the {what} {folder} is not writable; set {fix} to a writable folder")


class GPTCLI(TrainingCLI):
    """TrainingCLI with gpt_tp's checks before launch."""

    def before_instantiate_classes(self) -> None:
        """check_config; a fine-tune builds its checkpoint's model; `auto` layouts planned; `fit --simulate` runs."""
        cfg = self.config.get(self.subcommand) if self.subcommand else self.config
        check_config(cfg)
        resumed = resume_checkpoint(cfg) if self.subcommand else None
        saved = saved_state(resumed).get("hyper_parameters") or {} if resumed else {}
        if cfg.model.init_from is None and saved.get("init_from") is not None and isinstance(saved.get("model"), dict):
            cfg.model.model = Namespace(**saved["model"])  # a fine-tune: the model it built, not init_from's again
        elif cfg.model.init_from is not None:
            with contextlib.suppress(UserError):  # a folder GPTModule refuses: its loader names what is wrong with it
                built = built_config(cfg.model.model, cfg.model.init_from)  # its config.json decides the shape
                asked = GPTConfig.resolve(cfg.model.model)  # the run records the model built
                unused = [f"{k}={getattr(asked, k)}" for k in SHAPE_FIELDS if getattr(asked, k) != getattr(built, k)]
                if unused and not isinstance(cfg.model.model, str):
                    rank_zero_warn(f"model.init_from={cfg.model.init_from} builds its config.json's model ("
                                   f"{', '.join(f'{k}={getattr(built, k)}' for k in SHAPE_FIELDS)}); model.model's "
                                   f"{', '.join(unused)} are not used, and the run records the model built")
                cfg.model.model = Namespace(**dataclasses.asdict(built))
        init = getattr(cfg.trainer.strategy, "init_args", None)
        if init is not None and "auto" in (init.get("data_parallel_size"), init.get("tensor_parallel_size")):
            devices, nodes = self._devices(cfg, "plan an 'auto' layout")
            dp, tp = resolve_layout(
                built_config(cfg.model.model, cfg.model.init_from), devices * nodes, devices, nodes,
                cfg.data.batch_size, cfg.data.seq_len, detect_device_memory_gib(), str(cfg.trainer.precision),
                dp=init.data_parallel_size, tp=init.tensor_parallel_size, ac=cfg.model.activation_checkpointing,
                accum=cfg.trainer.accumulate_grad_batches or 1,
                total_batch_size=cfg.model.total_batch_size if self.subcommand == "fit" else None,
                optimizer=optimizer_from(cfg.model.optimizer.as_dict()).kind)
            init.data_parallel_size, init.tensor_parallel_size = dp, tp
            print(f"gpt_tp planner: DP={dp} x TP={tp} (python -m gpt_tp.cli.planner shows the table)", file=sys.stderr)
        if self.subcommand == "fit" and cfg.get("simulate"):
            self._simulate(cfg)

    @staticmethod
    def _devices(cfg, to: str) -> tuple[int, int]:
        """(devices per node, nodes) of a config that must name a number of devices `to` plan or simulate."""
        devices = device_count(cfg.trainer.devices)
        if devices is None:
            raise LayoutError(f"trainer.devices={cfg.trainer.devices!r}: give a number of devices per node to {to}")
        return devices, cfg.trainer.num_nodes

    def _simulate(self, cfg) -> None:
        """--simulate: the launch's checks, then one rank of the world in this process; exit 0, or 2 if it won't fit."""
        devices, nodes = self._devices(cfg, "simulate")
        run = self._resolve(built_config(cfg.model.model, cfg.model.init_from), devices, nodes, cuda=False)
        if not 0 <= cfg.simulate_rank < run.world:
            raise UserError(f"--simulate_rank={cfg.simulate_rank}: give a rank in 0..{run.world - 1}")
        m = cfg.model  # GPTModule's optimizer and schedule (max_steps: linked to trainer.max_steps), checked
        schedule = Schedule(m.max_lr, m.min_lr, m.warmup_steps, m.max_steps)
        sim = simulate(run, cfg.simulate_rank, optimizer_from(m.optimizer.as_dict()), schedule)
        memory = cfg.simulate_memory_gib if cfg.simulate_memory_gib is not None else detect_device_memory_gib()
        print(format_simulation(sim, memory), flush=True)
        if not sim.fits(memory):
            raise LayoutError(f"rank {sim.rank} of DP={run.dp} x TP={run.tp} needs {sim.peak['total'] / GIB:.1f} GiB at "
                              f"its peak, more than {USABLE_FRACTION:.0%} of {memory:g} GiB: raise tensor_parallel_size, "
                              "use more nodes, lower data.batch_size, or set model.activation_checkpointing")
        raise SystemExit(0)

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """The Trainer, gpt_tp's callbacks added to the config's (a progress bar and summary unless it has its own)."""
        trainer = self.config_init[self.subcommand]["trainer"] if self.subcommand else self.config_init["trainer"]
        callbacks = trainer.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        self._lists_checkpoint = any(isinstance(c, ModelCheckpoint) for c in callbacks)
        for flag, kind, default in (("enable_progress_bar", ProgressBar, StepProgressBar),
                                    ("enable_model_summary", ModelSummary, GPTSummary)):
            if trainer.get(flag) is not False and not any(isinstance(c, kind) for c in callbacks):
                callbacks = [*callbacks, default()]
        if not any(isinstance(c, Preemption) for c in callbacks):  # SIGTERM on every launch: save, stop together
            callbacks = [*callbacks, Preemption(dirpath=None, signal_name=None, requeue=False)]
        # a failed log write stops every rank; the final step saved; validate's rows' step; the plot's lineage
        trainer["callbacks"] = [*callbacks, LogWriteCheck(), FinalStep(), CheckpointStep(), RunLineage()]
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ModuleNotFoundError, ValueError) as e:  # a trainer.* value (devices=0, num_nodes=0)
            if "gpu backend" in str(e):
                raise UserError(f"trainer.accelerator={trainer.get('accelerator')}: this machine has no GPU; use "
                                "configs/cpu.yaml or --trainer.accelerator cpu") from e
            raise UserError(f"{e} (check the trainer.* settings)") from e

    def parse_arguments(self, parser, args) -> None:
        """A file given to --ckpt_path is refused here (checkpoints are folders), before Lightning unpickles it."""
        super().parse_arguments(parser, args)
        self._argv = sys.argv[1:] if args is None else list(args)
        sub = self.config.get("subcommand")
        ckpt = self.config[sub].get("ckpt_path") if sub else None
        if ckpt and os.path.isfile(ckpt):
            check_checkpoint(ckpt)  # raises CheckpointError: a file, not a distributed checkpoint folder

    # ---- checks before any process group or model shard exists (in the launching process: errors print once) ----
    def _check_layout(self) -> None:
        """The run resolved (GPTModule gets it), then the checkpoint to resume from and the folders the run writes to."""
        cfg = self.config[self.subcommand]
        devices, nodes = self.trainer.num_devices, self.trainer.num_nodes
        if devices > 1 and isinstance(self.trainer.accelerator, CPUAccelerator) and "OMP_NUM_THREADS" not in os.environ:
            # N processes on one CPU each default to every core: oversubscribed, mostly waiting. torchrun does the same.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
        check_launch(getattr(self.trainer.strategy, "cluster_environment", None), devices * nodes, devices, nodes)
        self.run = self._resolve(self.model.config, devices, nodes, isinstance(self.trainer.accelerator, CUDAAccelerator))
        self.model.use_run(self.run)
        ckpt = cfg.get("ckpt_path")
        folders = {cb.dirpath for cb in self.trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
        for folder in folders | ({os.path.dirname(os.path.abspath(ckpt))} if ckpt and ckpt not in CKPT_ALIASES else set()):
            recover_interrupted_saves(folder)  # a save killed while overwriting a name: its `.old` folder back first
        if ckpt is not None and ckpt not in CKPT_ALIASES:
            if not os.path.exists(ckpt):
                raise UserError(f"--ckpt_path {ckpt}: no such checkpoint (give a saved checkpoint folder, or 'last')")
            check_checkpoint(ckpt)  # a complete checkpoint folder, before any rank starts (shapes: at load)
        make_writable(self.trainer.default_root_dir, "log folder", "trainer.default_root_dir", "it")
        for lg in self.trainer.loggers:
            if getattr(lg, "save_dir", None) is not None:
                make_writable(lg.save_dir, "log folder", "trainer.logger", "the logger's save_dir")
        for folder in sorted(folders) if self.subcommand == "fit" else ():  # no room to save: fails now, not mid-run
            if ckpt is None and not cfg.overwrite_checkpoints:
                check_unused(folder)
            make_writable(folder, "checkpoint folder", "ModelCheckpoint dirpath", "its dirpath")
            free, need = shutil.disk_usage(folder).free, checkpoint_bytes(self.model.config)
            if free < need:
                raise UserError(f"ModelCheckpoint dirpath: {folder} has {human_bytes(free)} free, but a checkpoint of "
                                f"this model needs about {human_bytes(need)}; free space or choose another dirpath")
            if free < 2 * need:
                rank_zero_warn(f"checkpoint folder {folder}: {human_bytes(free)} free, room for fewer than two "
                               f"checkpoints of {human_bytes(need)}; a save that runs out of space stops the run")
        no_last = ckpt == "last" and folders and not any(glob.glob(os.path.join(f, "last*.ckpt")) for f in folders)
        if no_last and not relink_last(folders):  # a kill between Lightning's unlink and relink of last.ckpt
            if self.subcommand != "fit":
                raise UserError(f"--ckpt_path last: no checkpoint in {', '.join(sorted(folders))} yet; give a "
                                "checkpoint folder, or train one first with cli.py fit")
            # a first run under Slurm resumes with `last` before any save: Lightning's warning would advise save_last
            warnings.filterwarnings("ignore", message=".*there is no last checkpoint available")
            print(f"gpt_tp: no checkpoint in {', '.join(sorted(folders))}: starting from step 0", file=sys.stderr)

    def _resolve(self, config, devices: int, nodes: int, cuda: bool) -> Run:
        """This process's Run of the parsed arguments: the same checks and lines for a launch and for --simulate."""
        cfg = self.config[self.subcommand]
        fit = self.subcommand == "fit"
        dp, tp = map(int, parallel_sizes(cfg.trainer.strategy, devices * nodes))
        seq_len = cfg.data.seq_len if self.subcommand != "predict" else None
        model = cfg.model
        source = (f"model.init_from={model.init_from}" if model.init_from is not None
                  else f"model.model={model.model}" if isinstance(model.model, str) else None)
        return resolve_run(config, dp, tp, str(cfg.trainer.precision), model.activation_checkpointing, model.compile,
                           model.async_tp, seq_len, cfg.data.batch_size if fit else None,
                           1 if (acc := cfg.trainer.accumulate_grad_batches) is None else acc,
                           model.total_batch_size if fit else None,
                           world_size=devices * nodes, devices_per_node=devices, cuda=cuda,
                           flags=layout_flags(dp, tp, devices, nodes, seq_len, config, source))

    def _check_weights(self) -> None:
        """validate and predict score or continue with trained weights only, never the random init."""
        cfg = self.config[self.subcommand]
        if cfg.get("ckpt_path") is None and cfg.model.init_from is None:
            raise UserError(f"cli.py {self.subcommand} would use untrained weights: give --ckpt_path (a checkpoint "
                            "folder, or 'last') or --model.init_from (a Hugging Face GPT-2 folder)")

    def before_fit(self) -> None:
        cfg = self.config[self.subcommand]
        replaced = callbacks_replaced_by(self._argv)
        if self.trainer.checkpoint_callbacks and not self._lists_checkpoint and replaced:
            raise UserError(f"trainer.callbacks has no ModelCheckpoint: {replaced} lists trainer.callbacks, which "
                            "replaces the whole list (jsonargparse's rule), so this run would keep no checkpoint to "
                            f"resume; in {replaced} write `callbacks+:` to add to the list, or add "
                            "--trainer.callbacks+=gpt_tp.checkpoint.AtomicModelCheckpoint; or set "
                            "trainer.enable_checkpointing false")
        self._check_layout()
        if resumed := resume_checkpoint(cfg):
            check_not_complete(cfg.ckpt_path, resumed, self.trainer.max_steps)
        if cfg.get("ckpt_path"):  # a resume writes into the folder it resumes from: Lightning's warning is no news
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        find_shards(cfg.data.data_dir, "train")
        if cfg.data.val_batches:
            find_shards(cfg.data.data_dir, "val")
        accum = self.trainer.accumulate_grad_batches
        interval, max_steps = cfg.trainer.val_check_interval, self.trainer.max_steps
        if interval is not None and not interval > 0:
            raise UserError(f"trainer.val_check_interval={interval} must be > 0 (micro-batches, or a fraction of an "
                            "epoch); set data.val_batches=0 to train without validation")
        if (every := cfg.trainer.log_every_n_steps) is not None and every < 1:
            raise UserError(f"trainer.log_every_n_steps={every}: no training metric would be logged; give >= 1")
        if (clip := cfg.trainer.gradient_clip_val) is not None and clip < 0:
            raise UserError(f"trainer.gradient_clip_val={clip} must be >= 0 (a norm; 0 or null: no clipping)")
        if (warmup := cfg.model.warmup_steps) >= max_steps:
            last = get_lr(max_steps - 1, cfg.model.max_lr, cfg.model.min_lr, warmup, max_steps)
            rank_zero_warn(f"model.warmup_steps={warmup} >= trainer.max_steps={max_steps}: the run ends inside its warmup, "
                           f"its last step at lr {last:.3g} of model.max_lr={cfg.model.max_lr:g}, with no cosine decay")
        if isinstance(interval, int) and cfg.data.val_batches and max_steps > 0 and interval > max_steps * accum:
            rank_zero_warn(f"trainer.val_check_interval={interval} micro-batches is beyond the run's {max_steps} "
                           f"steps x {accum} accumulation: no validation will run; lower trainer.val_check_interval")
        if cfg.get("ckpt_path") is None and cfg.overwrite_checkpoints:  # last: every check above has passed
            for cb in self.trainer.checkpoint_callbacks:
                if getattr(cb, "dirpath", None):
                    remove_checkpoints(cb.dirpath)

    def before_validate(self) -> None:
        self._check_layout()
        find_shards(self.config[self.subcommand].data.data_dir, "val")
        self._check_weights()

    def before_predict(self) -> None:
        self._check_layout()
        self.datamodule.prompts.read()  # the prompts' mistakes, once, before any rank starts
        self._check_weights()

    # ---- one closing line per command, on rank 0: what it wrote -------------------------------------------------
    def _logs(self) -> str:
        dirs = [lg.log_dir for lg in self.trainer.loggers if getattr(lg, "log_dir", None)]
        return f"logs in {dirs[0]}" if dirs else "no logger"

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            saved = checkpoints_line(self.trainer) or "no checkpoint saved"
            print(f"gpt_tp fit: step {self.trainer.global_step}; {saved}; {self._logs()}", flush=True)

    def after_validate(self) -> None:
        if self.trainer.is_global_zero:
            print(f"gpt_tp validate: {self.config[self.subcommand].get('ckpt_path') or 'model.init_from'}; {self._logs()}",
                  flush=True)

    def after_predict(self) -> None:
        writer = next((cb for cb in self.trainer.callbacks if isinstance(cb, PromptWriter)), None)
        if self.trainer.is_global_zero and writer is not None:
            where = f"written to {writer.output}" if writer.output else "printed above (--output FILE writes them)"
            n = len(writer.rows)
            print(f"gpt_tp predict: {n} continuation{'s' * (n != 1)} {where}", flush=True)


def main(args: list[str] | None = None, model_class: type | None = None) -> GPTCLI:
    """Run `cli.py` with args (default: the command line); model_class: a GPTModule subclass to train instead."""
    quiet_lightning()
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "test":
        raise UserError("`test` is not a gpt_tp subcommand: the data has a train and a val split; "
                        "use `python cli.py validate --config ... --ckpt_path ...` for val loss and HellaSwag")
    return GPTCLI(args=args, **({} if model_class is None else {"model_class": model_class}))
