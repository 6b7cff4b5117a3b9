"""Distributed checkpoints: crash-safe saving, checked loading and resharding (the ModelParallel strategy), and
consolidation (load_consolidated). See docs/train.md, "Checkpoints"."""

import contextlib
import errno
import os
import re
import shutil
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, load as dcp_load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.constants import default_pg_timeout
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from gpt_tp.collective import one_does
from gpt_tp.train.lightning_internals import (  # noqa: F401 - configs name AtomicModelCheckpoint here
    META, AtomicModelCheckpoint, mark_saved, replace_same_names, save_step)
from gpt_tp.errors import UserError
from gpt_tp.sizing.sizes import checkpoint_bytes

if TYPE_CHECKING:
    from gpt_tp.model import GPTConfig

PARTIAL = ".partial"
OLD = ".old"  # a checkpoint being replaced under its name

SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SPACE_TEXTS = ("No space left on device", "Disk quota exceeded", f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]")


def is_space_error(e: BaseException | None) -> bool:
    """A full disk or quota anywhere in the chain (DCP wraps each rank's OSError, so its text counts too)."""
    while e is not None:
        if getattr(e, "errno", None) in SPACE_ERRNOS or any(t in str(e) for t in SPACE_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


def root_cause(e: BaseException) -> str:
    """The storage error under `e` in one line: the first `[Errno N] ...` in its chain or text, else its first line."""
    for x in (e, e.__cause__, e.__context__):
        if isinstance(x, OSError):
            return f"{type(x).__name__}: {x}"
        if x is not None and (found := re.search(r"\[Errno \d+\] [^\n]*", str(x))):
            return found[0]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the path or parameters and what to do."""


class CheckpointSpaceError(CheckpointError):
    """A checkpoint save ran out of space (ENOSPC or EDQUOT) on some rank: every rank stops with it, exit code 2."""


def check_checkpoint(path: str | os.PathLike, expected_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise CheckpointError unless `path` is a complete distributed checkpoint whose tensors (keys of
    expected_shapes, e.g. 'model.transformer.wte.weight') have the expected global shapes."""
    p = Path(path)
    if not p.exists():
        aside = p.with_name(p.name + OLD)
        if aside.is_dir():
            raise CheckpointError(f"checkpoint folder {p} does not exist: a save that replaced it was interrupted and "
                                  f"{aside} holds it; load {aside}, or resume training from {p} (which moves it back "
                                  "first)")
        raise CheckpointError(f"checkpoint folder {p} does not exist (for a run: --ckpt_path takes a checkpoint folder or 'last')")
    if p.name.endswith(PARTIAL):
        raise CheckpointError(f"{p} is an unfinished checkpoint (its save was interrupted); resume from a checkpoint without '{PARTIAL}'")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file, not a distributed checkpoint folder (.metadata + *.distcp + {META})")
    inside = sorted(d.name for d in p.iterdir() if (d / ".metadata").is_file()) if not (p / ".metadata").exists() else []
    if inside:
        pick = "last.ckpt" if "last.ckpt" in inside else inside[-1]
        raise CheckpointError(f"{p} is a folder of checkpoints ({len(inside)}), not one: give {p / pick}, or 'last'")
    if missing := [f for f in (".metadata", META) if not (p / f).is_file()]:
        raise CheckpointError(f"{p} is not a complete distributed checkpoint: {', '.join(missing)} missing")
    try:
        metadata = FileSystemReader(str(p)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is the same user error
        raise CheckpointError(f"{p}/.metadata is unreadable ({type(e).__name__}: {e}); the checkpoint is corrupt") from e
    files = {getattr(s, "relative_path", None) for s in (metadata.storage_data or {}).values()} - {None}
    if missing := sorted(f for f in files if not (p / f).is_file()):
        raise CheckpointError(f"{p} is missing shard files {', '.join(missing)}; copy the whole checkpoint folder")
    if expected_shapes is None:
        return
    saved = {k.removeprefix("state_dict."): tuple(v.size) for k, v in metadata.state_dict_metadata.items()
             if k.startswith("state_dict.") and isinstance(v, TensorStorageMetadata)}
    problems = [f"{k}: checkpoint {saved[k]} vs model {s}" for k, s in expected_shapes.items() if k in saved and saved[k] != s]
    problems += [f"{k}: in the model, not in the checkpoint" for k in expected_shapes if k not in saved]
    problems += [f"{k}: in the checkpoint, not in the model" for k in saved if k not in expected_shapes]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {p} does not fit this model (another model size?); set model.model to the "
                              f"size it was trained with: {problems[0]}{more}")


def check_same_optimizer(path: Path, optimizer: str) -> None:
    """A checkpoint resumes only with the optimizer that wrote its state (AdamW's moments are not Muon's buffers)."""
    saved = (torch.load(path / META, weights_only=True).get("hyper_parameters") or {}).get("optimizer", "adamw")
    if saved != optimizer:
        raise CheckpointError(f"checkpoint {path} holds model.optimizer={saved}'s state, but this run has "
                              f"model.optimizer={optimizer}: resume with --model.optimizer {saved}, or start a new run")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover_interrupted_saves(folder: str | os.PathLike, clean: bool = False) -> list[Path]:
    """Undo what a save killed mid-way left in `folder`: a `<name>.old` without its `<name>` goes back to `<name>`;
    with clean, other `.old` and all `.partial` folders go. Returns those put back; safe to run concurrently."""
    restored = []
    for old in sorted(Path(folder).glob(f"*{OLD}")):
        name = old.with_name(old.name.removesuffix(OLD))
        if not name.exists() and not name.is_symlink():
            with contextlib.suppress(FileNotFoundError):  # another process put it back first
                os.rename(old, name)
                restored.append(name)
        elif clean:
            shutil.rmtree(old, ignore_errors=True)
    if clean:
        for stale in Path(folder).glob(f"*{PARTIAL}"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in Path(folder).glob("*.ckpt.new"):  # a link a kill left before renaming it over last.ckpt
            stale.unlink(missing_ok=True)
    return restored


def _publish(tmp: Path, final: Path) -> None:
    """Make the finished `tmp` the checkpoint `final`, never leaving `final` without one that recover_interrupted_saves
    cannot bring back."""
    _fsync(tmp / META)
    _fsync(tmp)
    old = final.with_name(final.name + OLD)
    if final.is_symlink() or final.is_file():
        final.unlink()
    elif final.exists():
        os.rename(final, old)  # a crash from here to the next rename: recover_interrupted_saves puts `old` back
    os.rename(tmp, final)  # atomic: the checkpoint appears complete or not at all
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _continue_checkpointing(callbacks: list, checkpoint: dict, path: Path) -> None:
    """A resumed run's ModelCheckpoint callbacks carry on the saved run's: the loaded step counts as saved; a saved
    state with an empty last_model_path gets `<dirpath>/last.ckpt` (its unversioned last name) in the same folder; and
    a checkpoint resumed from a copy of its folder (`path` in the callback's dirpath, the state naming another) has
    its state's paths moved to the copy, so the copy keeps its newest K and its own last.ckpt."""
    states = checkpoint.get("callbacks") or {}
    for cb in (c for c in callbacks if isinstance(c, LightningModelCheckpoint)):
        if "global_step" in checkpoint:
            mark_saved(cb, checkpoint["global_step"])  # not restored by Lightning (gpt_tp.train.lightning_internals)
        state = states.get(cb.state_key)
        if not (isinstance(state, dict) and cb.dirpath):
            continue
        old = state.get("dirpath")
        if old and old != cb.dirpath and os.path.realpath(path.parent) == os.path.realpath(cb.dirpath):
            def moved(p: str) -> str:
                return os.path.join(cb.dirpath, os.path.basename(p)) if p and os.path.dirname(p) == old else p
            for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
                state[key] = moved(state.get(key) or "")
            state["best_k_models"] = {moved(k): v for k, v in (state.get("best_k_models") or {}).items()
                                      if os.path.lexists(moved(k))}
            state["dirpath"] = cb.dirpath
        if (cb.save_last and "{" not in cb.CHECKPOINT_NAME_LAST and not state.get("last_model_path")
                and state.get("dirpath") == cb.dirpath):
            state["last_model_path"] = cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST)


def checkpoints_line(trainer) -> str:
    """The closing line's account of the run's checkpoints, from each ModelCheckpoint's own last checkpoint:
    `checkpoints in DIR (last.ckpt -> step0000013.ckpt)`; '' when none was saved."""
    parts = []
    for cb in trainer.checkpoint_callbacks:
        last = getattr(cb, "last_model_path", "") or ""
        if last and os.path.lexists(last):
            link = f" -> {os.readlink(last)}" if os.path.islink(last) else ""
            parts.append(f"checkpoints in {cb.dirpath} ({os.path.basename(last)}{link})")
    return "; ".join(parts)


class FinalStep(Callback):
    """Every ModelCheckpoint saves the run's final step, whatever its every_n_train_steps (build-nanogpt saves at
    `step % N == 0 or last_step`), once, with last.ckpt naming it; and saves a name that exists over it, never as
    `<name>-v1.ckpt`. cli.py adds it to every run."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, LightningModelCheckpoint):
                replace_same_names(cb)

    def on_train_end(self, trainer, pl_module) -> None:  # before the ModelCheckpoints' own (Lightning puts them last)
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, LightningModelCheckpoint):
                save_step(cb, trainer)


class ModelParallel(ModelParallelStrategy):
    """ModelParallelStrategy whose saves appear only once complete and fail on all ranks together, whose loads check
    the folder first (on one device, TP=1 x DP=1, as plain tensors), and which resumes ModelCheckpoint as saved."""

    def __init__(self, data_parallel_size: int | str = "auto", tensor_parallel_size: int | str = "auto",
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.distributed_checkpoint = save_distributed_checkpoint  # a DCP folder (True) or one consolidated file

    def _on_every_rank(self, what: str, action: Callable[[], object]) -> None:
        """Run `action` on every rank (one_does, a barrier): a failure on any rank raises one CheckpointError on all."""

        def act() -> None:
            try:
                action()
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException; any failed write is the same
                raise CheckpointError(f"{what} failed on rank {self.global_rank}: {root_cause(e)}; fix the storage "
                                      "(space, permissions) and resume from the last checkpoint") from e

        one_does(act, doer=True)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if not self.distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        final = Path(self.broadcast(str(filepath)))
        tmp = final.with_name(final.name + PARTIAL)
        zero = self.is_global_zero
        if zero and not final.parent.is_dir():  # removed during the run: made again, said once
            rank_zero_warn(f"checkpoint folder {final.parent} was removed during the run: making it again (the "
                           "checkpoints it held are gone)")
        self._on_every_rank(f"preparing {final.parent}", lambda: zero and recover_interrupted_saves(final.parent, clean=True))
        try:
            self._on_every_rank(f"writing checkpoint {tmp}", lambda: super(ModelParallel, self).save_checkpoint(checkpoint, tmp, storage_options))
            self._on_every_rank(f"publishing checkpoint {final}", lambda: zero and _publish(tmp, final))
        except Exception as e:  # every rank is here with the failure (shared): the partial goes at once, then one line
            self._on_every_rank(f"removing {tmp}", lambda: zero and shutil.rmtree(tmp, ignore_errors=True))
            # a full disk or quota: named by its errno where one survives, else by what is left (torch's zip writer
            # turns a short write into "unexpected pos" with no errno)
            need, free = checkpoint_bytes(self.lightning_module.config), shutil.disk_usage(final.parent).free
            if not (is_space_error(e) or free < need):
                raise
            raise CheckpointSpaceError(
                f"no space left to save {final.name} in {final.parent} ({human_bytes(free)} free; "
                f"a checkpoint needs about {human_bytes(need)}): free space, lower save_top_k, or choose another dirpath; the "
                f"checkpoints already there are intact (resume with --ckpt_path last)") from None

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(str(checkpoint_path)))
        self._on_every_rank(f"recovering {path.parent}", lambda: self.is_global_zero and recover_interrupted_saves(path.parent))
        state = self.lightning_module.state_dict()  # global (unsharded) shapes, DTensor or not
        check_checkpoint(path, {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)})
        check_same_optimizer(path, self.lightning_module.hparams.get("optimizer", "adamw"))
        sharded = any(isinstance(p, DTensor) for p in self.model.parameters())
        checkpoint = super().load_checkpoint(path, weights_only=True) if sharded else self._load_plain(path)
        _continue_checkpointing(self.lightning_module.trainer.checkpoint_callbacks, checkpoint, path)
        return checkpoint

    def _load_plain(self, path: Path) -> dict:
        """One device, plain tensors: DCP assembles the full tensors from whatever layout saved them."""
        module_state = {"state_dict": get_model_state_dict(self.model)}
        dcp_load(module_state, checkpoint_id=path)
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            optim_state = {f"optimizer_{i}": get_optimizer_state_dict(self.model, optimizer)}
            dcp_load(optim_state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optim_state[f"optimizer_{i}"], options=StateDictOptions(cpu_offload=True))
        return torch.load(path / META, weights_only=True)


def load_consolidated(path: str | os.PathLike) -> tuple["GPTConfig", dict[str, torch.Tensor]]:
    """Read a distributed checkpoint in one process, without a process group: (the model's GPTConfig, the full
    single-device GPT state dict). Used by the export and HellaSwag commands."""
    from gpt_tp.model import GPT, GPTConfig

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
