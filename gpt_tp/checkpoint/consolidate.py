"""load_consolidated: a distributed checkpoint read whole in one process, without a process group (export, HellaSwag)."""

import os
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import load as dcp_load

from gpt_tp.checkpoint.lightning_internals import META
from gpt_tp.checkpoint.store import CheckpointError, check_checkpoint
from gpt_tp.model import GPT, GPTConfig


def load_consolidated(path: str | os.PathLike) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(the model's GPTConfig, its full single-device GPT state dict) from a distributed checkpoint."""
    check_checkpoint(path)
    hparams = torch.load(Path(path) / META, weights_only=True).get("hyper_parameters") or {}
    if "model" not in hparams:
        raise CheckpointError(f"{path}/{META} holds no gpt_tp hyper-parameters: not a gpt_tp checkpoint")
    config = GPTConfig.resolve(hparams["model"])
    with torch.device("meta"):
        gpt = GPT(config)
    gpt.to_empty(device="cpu")
    gpt.tie_weights()
    state = {"state_dict": {f"model.{k}": v for k, v in gpt.state_dict().items()}}
    check_checkpoint(path, {k: tuple(v.shape) for k, v in state["state_dict"].items()})
    with warnings.catch_warnings():  # one process by design: DCP's "torch.distributed is disabled" is no news here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, checkpoint_id=Path(path))  # in place: into gpt's own tensors
    return config, gpt.state_dict()
