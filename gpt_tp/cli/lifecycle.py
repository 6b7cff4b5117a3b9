"""A run's start, checked by cli.py before any process group exists: the checkpoint a resume reads, the folder a fresh
run writes into, the launch environment, the config file that replaced trainer.callbacks (docs/train.md)."""

import contextlib
import os
import shutil
import socket
import time
from pathlib import Path

import torch
import yaml
from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

from gpt_tp.errors import UserError
from gpt_tp.checkpoint.lightning_internals import META

# what torchrun exports to its workers; a shell that kept them makes a plain `cli.py fit` wait for peers
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_ERROR_FILE")
CKPT_ALIASES = ("last", "best", "hpc", "registry")  # --ckpt_path values Lightning resolves itself
RENDEZVOUS_TIMEOUT_S = 30.0  # torchrun's store is up before its workers start; Lightning's rank 0 within seconds


def resume_checkpoint(cfg) -> str | None:
    """The folder a parsed config's --ckpt_path names ('last': a dirpath's last.ckpt); None: none (yet), or an alias."""
    ckpt = cfg.get("ckpt_path")
    if ckpt != "last":
        return None if ckpt is None or ckpt in CKPT_ALIASES else ckpt
    callbacks = cfg.trainer.callbacks or []
    for cb in callbacks if isinstance(callbacks, list) else [callbacks]:
        is_checkpoint = cb.get("class_path", "").endswith("Checkpoint")
        dirpath = (cb.get("init_args") or {}).get("dirpath") if is_checkpoint else None
        if dirpath and os.path.lexists(last := os.path.join(dirpath, "last.ckpt")):
            return last
    return None


def saved_state(path: str) -> dict:
    """A checkpoint folder's meta.pt (step counters, hyper-parameters; no tensors of the model); {} if unreadable."""
    try:
        return torch.load(Path(path) / META, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - the load itself names what is wrong with the folder
        return {}


def check_not_complete(flag: str, path: str, max_steps: int) -> None:
    """A resume from a checkpoint at or past trainer.max_steps would train nothing: refused."""
    step = saved_state(path).get("global_step")
    if max_steps != -1 and step is not None and step >= max_steps:
        raise UserError(f"--ckpt_path {flag}: the run is already complete ({path} is at step {step} >= "
                        f"trainer.max_steps {max_steps}); raise --trainer.max_steps to train further")


def check_unused(folder: str) -> None:
    """A fresh run refuses a `folder` holding another run's checkpoints: its last.ckpt would name the wrong run."""
    if taken := sorted(p.name for p in Path(folder).glob("*.ckpt*")):
        names = ", ".join(taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
        raise UserError(f"ModelCheckpoint dirpath {folder} holds another run's checkpoints ({names}): continue that "
                        "run with --ckpt_path last, set another dirpath, or pass --overwrite_checkpoints true to "
                        "delete them and start from step 0")


def remove_checkpoints(folder: str) -> None:
    """Delete every `*.ckpt*` entry of `folder` (--overwrite_checkpoints); every rank's cli.py may do it at once."""
    for p in Path(folder).glob("*.ckpt*"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def check_launch(env, world: int, devices: int, nodes: int) -> None:
    """Refuse, before anything waits, a Slurm allocation of another size or torchrun's variables with no rendezvous."""
    if isinstance(env, SLURMEnvironment):
        tasks = int(os.environ.get("SLURM_NTASKS", world))
        if tasks != world:
            raise UserError(f"this Slurm allocation runs {tasks} task(s), but the config trains on trainer.devices="
                            f"{devices} x trainer.num_nodes={nodes} = {world} processes: allocate "
                            f"--nodes={nodes} --ntasks-per-node={devices} (sbatch/srun), or set trainer.devices and "
                            "trainer.num_nodes to the allocation")
        return
    if not isinstance(env, (LightningEnvironment, TorchElasticEnvironment)) or "LOCAL_RANK" not in os.environ:
        return  # Lightning starts the other processes itself
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not (agent_store or rank != 0):
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


def callbacks_replaced_by(argv: list[str]) -> str | None:
    """The --config file that set (replaced) trainer.callbacks last; None if the command line or nothing did."""
    source = None
    for flag, value in zip(argv, [*argv[1:], None]):
        if flag in ("--config", "-c") and value and os.path.isfile(value):
            with open(value) as f:
                data = yaml.safe_load(f) or {}
            trainer = data.get("trainer") if isinstance(data, dict) else None
            if isinstance(trainer, dict) and "callbacks" in trainer:
                source = value
        elif flag == "--trainer.callbacks" or flag.startswith("--trainer.callbacks="):
            source = None
    return source
