"""The checks before launch, one function per thing checked, run by GPTCLI's hooks in the launching process before
any process group exists (an error prints once): the launch, the checkpoint a run resumes, the folders it writes to,
the trainer's values (docs/train.md, "A run's lifecycle")."""

import contextlib
import glob
import os
import shutil
import socket
import time
import warnings
from pathlib import Path

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from gpt_tp.data.shards import find_shards, make_writable
from gpt_tp.errors import UserError
from gpt_tp.checkpoint.contents import Contents, read_contents
from gpt_tp.checkpoint.last import relink_last
from gpt_tp.checkpoint.store import CheckpointError, check_checkpoint, checkpoint_space, human_bytes, recover_interrupted_saves
from gpt_tp.train.optim import get_lr

# what torchrun exports to its workers; a shell that kept them makes a plain `cli.py fit` wait for peers
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_ERROR_FILE")
CKPT_ALIASES = ("last", "best", "hpc", "registry")  # --ckpt_path values Lightning resolves itself
RENDEZVOUS_TIMEOUT_S = 30.0  # torchrun's store is up before its workers start; Lightning's rank 0 within seconds


def set_threads(trainer) -> None:
    """N processes on one CPU each default to every core: oversubscribed, mostly waiting. torchrun does the same."""
    devices = trainer.num_devices
    if devices > 1 and isinstance(trainer.accelerator, CPUAccelerator) and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))


def check_launch(trainer) -> None:
    """Refuse, before anything waits, a Slurm allocation of another size or torchrun's variables with no rendezvous."""
    env, devices, nodes = getattr(trainer.strategy, "cluster_environment", None), trainer.num_devices, trainer.num_nodes
    if isinstance(env, SLURMEnvironment):
        tasks, world = int(os.environ.get("SLURM_NTASKS", devices * nodes)), devices * nodes
        if tasks != world:
            raise UserError(f"this Slurm allocation runs {tasks} task(s), but the config trains on trainer.devices="
                            f"{devices} x trainer.num_nodes={nodes} = {world} processes: allocate "
                            f"--nodes={nodes} --ntasks-per-node={devices} (sbatch/srun), or set trainer.devices and "
                            "trainer.num_nodes to the allocation")
        return
    if not isinstance(env, (LightningEnvironment, TorchElasticEnvironment)) or "RANK" not in os.environ:
        return  # Lightning's launcher (its processes have LOCAL_RANK, not RANK): the first node waits for the others
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not (agent_store or int(os.environ["RANK"]) != 0):
        return  # rank 0 without torchrun's store serves the rendezvous itself: nothing to ask
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while time.monotonic() <= deadline:
        with contextlib.suppress(OSError):
            socket.create_connection((addr, port), timeout=2).close()
            return
        time.sleep(0.5)
    names = " ".join(k for k in TORCHRUN_VARS if k in os.environ)
    raise UserError(f"nothing answers the rendezvous at {addr}:{port} after {RENDEZVOUS_TIMEOUT_S:g} s: this shell "
                    f"holds torchrun's variables ({names}), left by an earlier job? `unset {names}` and run again, or "
                    "start the run under torchrun")


def checkpoint_folders(trainer) -> set[str]:  # every ModelCheckpoint's dirpath
    return {cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}


def resumed(cfg) -> tuple[str | None, Contents | None]:
    """The checkpoint a parsed config's --ckpt_path resumes ('last': a dirpath's last.ckpt) and what it holds; None
    for none (yet) or an alias, and for contents it cannot read (the load names what is wrong)."""
    ckpt, path = cfg.get("ckpt_path"), None
    if ckpt == "last":
        callbacks = cfg.trainer.callbacks or []
        for cb in callbacks if isinstance(callbacks, list) else [callbacks]:
            dirpath = (cb.get("init_args") or {}).get("dirpath") if cb.get("class_path", "").endswith("Checkpoint") else None
            if dirpath and os.path.lexists(last := os.path.join(dirpath, "last.ckpt")):
                path = last
                break
    elif ckpt not in (None, *CKPT_ALIASES):
        path = ckpt
    with contextlib.suppress(CheckpointError):
        return path, read_contents(path) if path else None
    return path, None


def recover_saves(folders: set[str], ckpt: str | None) -> None:
    """A save killed while overwriting a name: its `.old` folder back first, in the checkpoint folders and --ckpt_path's."""
    for folder in folders | ({os.path.dirname(os.path.abspath(ckpt))} if ckpt and ckpt not in CKPT_ALIASES else set()):
        recover_interrupted_saves(folder)


def check_ckpt_path(ckpt: str | None, parsed: bool = False) -> None:
    """--ckpt_path names a complete checkpoint folder or a readable file, before any rank starts (shapes: at load);
    `parsed`: just parsed, before interrupted saves are recovered, only a file is read (before Lightning unpickles it)."""
    if ckpt is not None and ckpt not in CKPT_ALIASES and not (parsed and not os.path.isfile(ckpt)):
        if not os.path.exists(ckpt):
            raise UserError(f"--ckpt_path {ckpt}: no such checkpoint (give a saved checkpoint folder, or 'last')")
        read_contents(ckpt) if os.path.isfile(ckpt) else check_checkpoint(ckpt)  # a file: read without unpickling


def check_strategy_reads(path: str | None, trainer) -> None:
    """A distributed checkpoint folder loads under ModelParallel only (any layout); a one-process strategy reads files."""
    if path and os.path.isdir(path) and not isinstance(trainer.strategy, ModelParallelStrategy):
        raise UserError(f"--ckpt_path {path} is a distributed checkpoint folder, which trainer.strategy="
                        f"{type(trainer.strategy).__name__} cannot load: load it on one device with --trainer.strategy "
                        "gpt_tp.checkpoint.ModelParallel --trainer.strategy.init_args.tensor_parallel_size 1")


def check_not_complete(cfg, max_steps: int) -> None:
    """A resume from a checkpoint at or past trainer.max_steps would train nothing: refused."""
    path, contents = resumed(cfg)
    step = contents.step if contents else None
    if max_steps != -1 and step is not None and step >= max_steps:
        raise UserError(f"--ckpt_path {cfg.ckpt_path}: the run is already complete ({path} is at step {step} >= "
                        f"trainer.max_steps {max_steps}); raise --trainer.max_steps to train further")


def check_log_folders(trainer) -> None:
    """trainer.default_root_dir and every logger's save_dir can be written."""
    make_writable(trainer.default_root_dir, "the log folder", "trainer.default_root_dir", "set it to a writable folder")
    for lg in trainer.loggers:
        if getattr(lg, "save_dir", None) is not None:
            make_writable(lg.save_dir, "the log folder", "trainer.logger", "set the logger's save_dir to a writable folder")


def check_unused(folder: str) -> None:
    """A fresh run refuses a `folder` holding another run's checkpoints: its last.ckpt would name the wrong run."""
    if taken := sorted(p.name for p in Path(folder).glob("*.ckpt*")):
        names = ", ".join(taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
        raise UserError(f"ModelCheckpoint dirpath {folder} holds another run's checkpoints ({names}): continue that "
                        "run with --ckpt_path last, set another dirpath, or pass --overwrite_checkpoints true to "
                        "delete them and start from step 0")


def check_space(folder: str, config) -> None:
    """Room in `folder` for a checkpoint of the model, or the run fails now, not mid-run; a warning under two."""
    free, need = checkpoint_space(folder, config)
    if free < need:
        raise UserError(f"ModelCheckpoint dirpath: {folder} has {human_bytes(free)} free, but a checkpoint of "
                        f"this model needs about {human_bytes(need)}; free space or choose another dirpath")
    if free < 2 * need:
        rank_zero_warn(f"checkpoint folder {folder}: {human_bytes(free)} free, room for fewer than two "
                       f"checkpoints of {human_bytes(need)}; a save that runs out of space stops the run")


def check_last(folders: set[str], ckpt: str | None, subcommand: str) -> None:
    """--ckpt_path last with no last.ckpt: linked to the newest checkpoint again (a kill between Lightning's unlink and
    relink), else fit starts from step 0 and validate or predict is refused; refused with no folder to look in."""
    if ckpt == "last" and not folders:
        raise UserError("--ckpt_path last: no ModelCheckpoint has a dirpath, so there is no folder to find last.ckpt in; "
                        "set its dirpath (--trainer.callbacks.dirpath checkpoints/run after the --trainer.callbacks+= "
                        "that adds it), or give --ckpt_path a checkpoint folder")
    if ckpt != "last" or any(glob.glob(os.path.join(f, "last*.ckpt")) for f in folders) or relink_last(folders):
        return
    if subcommand != "fit":
        raise UserError(f"--ckpt_path last: no checkpoint in {', '.join(sorted(folders))} yet; give a "
                        "checkpoint folder, or train one first with cli.py fit")
    # a first run under Slurm resumes with `last` before any save: Lightning's warning would advise save_last
    warnings.filterwarnings("ignore", message=".*there is no last checkpoint available")
    rank_zero_info(f"gpt_tp: no checkpoint in {', '.join(sorted(folders))}: starting from step 0")


def check_checkpoint_listed(listed: list, trainer) -> None:
    """A trainer.callbacks list that names callbacks but no ModelCheckpoint, while checkpointing is on, replaced the
    config's list (jsonargparse replaces a whole list): the run would keep only Lightning's default checkpoint."""
    if listed and trainer.checkpoint_callbacks and not any(isinstance(c, ModelCheckpoint) for c in listed):
        raise UserError("trainer.callbacks has no ModelCheckpoint: the last trainer.callbacks given (a --config file's "
                        "list, or the command line's) replaces the whole list (jsonargparse's rule), so this run would "
                        "keep no checkpoint to resume; add to the list instead, with `callbacks+:` in a config file or "
                        "--trainer.callbacks+=CLASS on the command line, or add "
                        "--trainer.callbacks+=gpt_tp.checkpoint.AtomicModelCheckpoint --trainer.callbacks.dirpath "
                        "checkpoints/run --trainer.callbacks.save_last link (a fixed folder: --ckpt_path last resumes "
                        "from it); or set trainer.enable_checkpointing false")


def check_shards(cfg, subcommand: str) -> None:
    """data.data_dir holds the splits the command reads: fit's train (and val with data.val_batches), validate's val."""
    if subcommand == "fit":
        find_shards(cfg.data.data_dir, "train")
    if subcommand == "validate" or cfg.data.val_batches:
        find_shards(cfg.data.data_dir, "val")


def check_trainer_values(cfg, trainer) -> None:
    """trainer.* values a gpt_tp run cannot use; a warning if it ends inside its warmup, or before it would validate."""
    if (interval := cfg.trainer.val_check_interval) is not None and not interval > 0:
        raise UserError(f"trainer.val_check_interval={interval} must be > 0 (micro-batches, or a fraction of an "
                        "epoch); set data.val_batches=0 to train without validation")
    if (every := cfg.trainer.log_every_n_steps) is not None and every < 1:
        raise UserError(f"trainer.log_every_n_steps={every}: no training metric would be logged; give >= 1")
    if (clip := cfg.trainer.gradient_clip_val) is not None and clip < 0:
        raise UserError(f"trainer.gradient_clip_val={clip} must be >= 0 (a norm; 0 or null: no clipping)")
    accum, max_steps = trainer.accumulate_grad_batches, trainer.max_steps
    if (warmup := cfg.model.warmup_steps) >= max_steps:
        last = get_lr(max_steps - 1, cfg.model.max_lr, cfg.model.min_lr, warmup, max_steps)
        rank_zero_warn(f"model.warmup_steps={warmup} >= trainer.max_steps={max_steps}: the run ends inside its warmup, "
                       f"its last step at lr {last:.3g} of model.max_lr={cfg.model.max_lr:g}, with no cosine decay")
    if isinstance(interval, int) and cfg.data.val_batches and max_steps > 0 and interval > max_steps * accum:
        rank_zero_warn(f"trainer.val_check_interval={interval} micro-batches is beyond the run's {max_steps} "
                       f"steps x {accum} accumulation: no validation will run; lower trainer.val_check_interval")


def check_weights(cfg, subcommand: str) -> None:
    """validate and predict score or continue with trained weights only, never the random init."""
    if cfg.get("ckpt_path") is None and cfg.model.init_from is None:
        raise UserError(f"cli.py {subcommand} would use untrained weights: give --ckpt_path (a checkpoint "
                        "folder, or 'last') or --model.init_from (a Hugging Face GPT-2 folder)")


def remove_checkpoints(folders: set[str]) -> None:
    """Delete every `*.ckpt*` entry of `folders` (--overwrite_checkpoints), said once; every rank may do it at once."""
    for folder in sorted(folders):
        if found := sorted(Path(folder).glob("*.ckpt*")):
            rank_zero_info(f"gpt_tp: --overwrite_checkpoints removed {', '.join(p.name for p in found)} from {folder}")
        for p in found:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
