"""cli.py's launcher: GPTCLI, TrainingCLI whose hooks run gpt_tp.cli.checks in order in the launching process (errors
print once), add gpt_tp's callbacks to the Trainer and print each command's closing line."""

import sys
import warnings

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from gpt_tp.errors import UserError
from gpt_tp.hardware import GIB, detect_device_memory_gib
from gpt_tp.sizing import LayoutError
from gpt_tp.sizing.memory import USABLE_FRACTION
from gpt_tp.checkpoint.last import FinalStep, checkpoints_line
from gpt_tp.cli import checks
from gpt_tp.cli.config import TrainingCLI, built_config, check_config, counted_devices, plan_layout, resolve_model, run_of
from gpt_tp.train.logs import CheckpointStep, LogWriteCheck, RunLineage, quiet_lightning
from gpt_tp.train.optim import Schedule, optimizer_from
from gpt_tp.infer.predict import PromptWriter
from gpt_tp.train.progress import GPTSummary, StepProgressBar
from gpt_tp.cli.simulate import format_simulation, simulate
from gpt_tp.cluster.slurm import FailFast, Preemption


class GPTCLI(TrainingCLI):
    """TrainingCLI with gpt_tp's checks before launch."""

    def before_instantiate_classes(self) -> None:
        """check_config; the model the run builds; `auto` layouts planned; `fit --simulate` runs."""
        cfg = self.config.get(self.subcommand) if self.subcommand else self.config
        check_config(cfg)
        if str(cfg.trainer.accelerator) in ("gpu", "cuda") and not cfg.get("simulate") and not torch.cuda.is_available():
            raise UserError(f"trainer.accelerator={cfg.trainer.accelerator}: this machine has no GPU; use configs/cpu.yaml "
                            "or --trainer.accelerator cpu")  # before the callbacks' own checks (HellaSwag's file)
        resolve_model(cfg, *(checks.resumed(cfg) if self.subcommand else (None, None)), self.argv)
        plan_layout(cfg, fit=self.subcommand == "fit")
        if self.subcommand == "fit" and cfg.get("simulate"):
            self._simulate(cfg)

    def _simulate(self, cfg) -> None:
        """--simulate: the launch's checks, then one rank of the world in this process; exit 0, or 2 if it won't fit."""
        devices, nodes = counted_devices(cfg, "simulate")
        run = run_of(cfg, "fit", built_config(cfg.model.model, cfg.model.init_from), devices, nodes)
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
        self.listed_callbacks = callbacks  # the config's own (check_checkpoint_listed)
        for flag, kind, default in (("enable_progress_bar", ProgressBar, StepProgressBar),
                                    ("enable_model_summary", ModelSummary, GPTSummary)):
            if trainer.get(flag) is not False and not any(isinstance(c, kind) for c in callbacks):
                callbacks = [*callbacks, default()]
        if not any(isinstance(c, Preemption) for c in callbacks):  # SIGTERM on every launch: save, stop together
            callbacks = [*callbacks, Preemption(dirpath=None, signal_name=None, requeue=False)]
        if not any(isinstance(c, FailFast) for c in callbacks):  # a dead peer: one line, not gloo's traceback
            callbacks = [*callbacks, FailFast(stall_timeout_s=None)]
        # a failed log write stops every rank; the final step saved; validate's rows' step; the plot's lineage
        trainer["callbacks"] = [*callbacks, LogWriteCheck(), FinalStep(), CheckpointStep(), RunLineage()]
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ModuleNotFoundError, ValueError) as e:  # a trainer.* value (devices=0, num_nodes=0)
            raise UserError(f"{e} (check the trainer.* settings)") from e

    def _before_launch(self) -> None:
        """Before any process group or model shard exists: the launch checked, the run resolved (GPTModule gets it),
        then the checkpoint it resumes and the folders it writes to."""
        cfg, trainer, fit = self.config[self.subcommand], self.trainer, self.subcommand == "fit"
        checks.set_threads(trainer)
        checks.check_launch(trainer)
        self.model.use_run(run_of(cfg, self.subcommand, self.model.config, trainer.num_devices, trainer.num_nodes))
        ckpt, folders = cfg.get("ckpt_path"), checks.checkpoint_folders(trainer)
        checks.recover_saves(folders, ckpt)
        checks.check_ckpt_path(ckpt)
        checks.check_log_folders(trainer)
        for folder in sorted(folders) if fit else ():  # no room to save: fails now, not mid-run
            if ckpt is None and not cfg.overwrite_checkpoints:
                checks.check_unused(folder)
            checks.make_writable(folder, "the checkpoint folder", "ModelCheckpoint dirpath",
                                 "set its dirpath to a writable folder")
            checks.check_space(folder, self.model.config)
        checks.check_last(folders, ckpt, self.subcommand)
        checks.check_strategy_reads(checks.resumed(cfg)[0], trainer)

    def before_fit(self) -> None:
        cfg = self.config[self.subcommand]
        checks.check_checkpoint_listed(self.listed_callbacks, self.trainer)
        self._before_launch()
        checks.check_not_complete(cfg, self.trainer.max_steps)
        if cfg.get("ckpt_path"):  # a resume writes into the folder it resumes from: Lightning's warning is no news
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        checks.check_shards(cfg, self.subcommand)
        checks.check_trainer_values(cfg, self.trainer)
        if cfg.get("ckpt_path") is None and cfg.overwrite_checkpoints:  # last: every check above has passed
            checks.remove_checkpoints(checks.checkpoint_folders(self.trainer))

    def before_validate(self) -> None:
        self._before_launch()
        checks.check_shards(self.config[self.subcommand], self.subcommand)
        checks.check_weights(self.config[self.subcommand], self.subcommand)

    def before_predict(self) -> None:
        self._before_launch()
        self.datamodule.prompts.read()  # the prompts' mistakes, once, before any rank starts
        checks.check_weights(self.config[self.subcommand], self.subcommand)

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
    if (sys.argv[1:] if args is None else args)[:1] == ["test"]:
        raise UserError("`test` is not a gpt_tp subcommand: the data has a train and a val split; "
                        "use `python cli.py validate --config ... --ckpt_path ...` for val loss and HellaSwag")
    return GPTCLI(args=args, **({} if model_class is None else {"model_class": model_class}))
