"""What a checkpoint holds, read in one place: Contents (its model, optimizer, step) and the model's full weights from a
distributed checkpoint (load_consolidated). Lightning's key names of a checkpoint live here only."""

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import load as dcp_load

from gpt_tp.checkpoint.lightning_internals import META
from gpt_tp.checkpoint.store import CheckpointError, check_checkpoint
from gpt_tp.model import GPT, GPTConfig

HPARAMS, WEIGHTS, STEP, CALLBACKS = "hyper_parameters", "state_dict", "global_step", "callbacks"  # Lightning's keys
OPTIMIZERS = "optimizer_states"  # a checkpoint file's list of optimizer state dicts


@dataclass(frozen=True)
class Contents:
    """What a checkpoint holds beside its tensors: Lightning's checkpoint dict, or a distributed checkpoint's meta.pt."""

    hparams: dict  # GPTModule's hyper-parameters as saved ({}: none)
    step: int | None  # the optimizer steps trained (None: not a training checkpoint)
    callbacks: dict  # each callback's saved state by its state_key (the checkpoint's own dict: changes go into it)

    @classmethod
    def of(cls, checkpoint: dict) -> "Contents":
        """The contents of Lightning's checkpoint dict (a hook's, or a loaded file's)."""
        return cls(checkpoint.get(HPARAMS) or {}, checkpoint.get(STEP), checkpoint.get(CALLBACKS) or {})

    @property
    def model(self) -> GPTConfig | None:  # the model its GPTModule built; None: no gpt_tp hyper-parameters
        return GPTConfig.resolve(self.hparams["model"]) if "model" in self.hparams else None

    @property
    def optimizer(self) -> str:  # the class of model.optimizer, whose state it holds
        return optimizer_name(self.hparams.get("optimizer"))


def optimizer_name(optimizer) -> str:
    """The optimizer class of a model.optimizer hyper-parameter ({"class_path": ...}; none: AdamW)."""
    return optimizer["class_path"].rpartition(".")[2] if isinstance(optimizer, dict) else "AdamW"


def read_contents(path: str | os.PathLike) -> Contents:
    """The contents of the distributed checkpoint folder `path` (its meta.pt), or of a one-process strategy's
    checkpoint file (`--trainer.strategy auto`, mapped, not read whole); CheckpointError if unreadable."""
    p = Path(path)
    target = p if p.is_file() else p / META
    try:
        return Contents.of(torch.load(target, mmap=target == p, weights_only=True, map_location="cpu"))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same mistake
        what = (f"{p} is a file, not a distributed checkpoint folder (.metadata + *.distcp + {META}) nor a readable "
                "Lightning checkpoint" if target == p else f"{target} is unreadable")
        raise CheckpointError(f"{what} ({type(e).__name__}: {e})") from e


def load_consolidated(path: str | os.PathLike) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(the model's GPTConfig, its full single-device GPT state dict) from a distributed checkpoint, in one process
    without a process group, whatever layout saved it."""
    check_checkpoint(path, part=slice(None))
    config = read_contents(path).model
    if config is None:
        raise CheckpointError(f"{path}/{META} holds no gpt_tp hyper-parameters: not a gpt_tp checkpoint")
    with torch.device("meta"):
        gpt = GPT(config)
    gpt.to_empty(device="cpu")
    gpt.tie_weights()
    state = {WEIGHTS: {f"model.{k}": v for k, v in gpt.state_dict().items()}}
    check_checkpoint(path, {k: tuple(v.shape) for k, v in state[WEIGHTS].items()})
    with warnings.catch_warnings():  # one process by design: DCP's "torch.distributed is disabled" is no news here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, checkpoint_id=Path(path))  # in place: into gpt's own tensors
    return config, gpt.state_dict()
