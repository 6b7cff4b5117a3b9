"""ModelParallel, the configs' strategy: its checkpoints crash-safe, checked and reshardable (docs/train.md)."""

import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.checkpoint import CheckpointException, async_save, load as dcp_load
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.constants import default_pg_timeout

from gpt_tp.checkpoint.lightning_internals import META, mark_saved, setup_with_mesh
from gpt_tp.checkpoint.contents import OPTIMIZERS, WEIGHTS, Contents, optimizer_name, read_contents
from gpt_tp.checkpoint.store import (CheckpointError, PARTIAL, check_checkpoint, checkpoint_space, checksums,
                                     human_bytes, is_space_error, publish, recover_interrupted_saves, root_cause)
from gpt_tp.collective import one_does
from gpt_tp.parallel import is_parallelized


def _continue_checkpointing(callbacks: list, checkpoint: dict, path: Path) -> None:
    """A resumed run's ModelCheckpoint callbacks carry on the saved run's: the loaded step counts as saved; a saved
    state with an empty last_model_path gets `<dirpath>/last.ckpt` (its unversioned last name) in the same folder; and
    a checkpoint resumed from a copy of its folder (`path` in the callback's dirpath, the state naming another) has
    its state's paths moved to the copy, so the copy keeps its newest K and its own last.ckpt."""
    saved = Contents.of(checkpoint)
    for cb in (c for c in callbacks if isinstance(c, LightningModelCheckpoint)):
        if saved.step is not None:
            mark_saved(cb, saved.step)  # not restored by Lightning (gpt_tp.checkpoint.lightning_internals)
        state = saved.callbacks.get(cb.state_key)
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


class ModelParallel(ModelParallelStrategy):
    """ModelParallelStrategy whose saves appear only once complete and fail on all ranks together, whose loads check
    the folder first (on one device, TP=1 x DP=1, as plain tensors), and which resumes ModelCheckpoint as saved."""

    def __init__(self, data_parallel_size: int | str = "auto", tensor_parallel_size: int | str = "auto",
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, async_save: bool = False) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.distributed_checkpoint = save_distributed_checkpoint  # a DCP folder (True) or one consolidated file
        self.async_save = async_save  # stage a copy, write it in the background, commit when every rank's is written
        self._saved_in: set[Path] = set()  # the folders this run has saved into
        self._in_flight: tuple[Path, Future, list[Callable[[], object]]] | None = None  # the save being written
        self._writer = None  # asynchronous saves: (stager, its gloo groups, a thread), made at the first

    setup_environment = setup_with_mesh  # Lightning's, its mesh made by gpt_tp.ranks.build_mesh (every path's)

    def _on_every_rank(self, what: str, action: Callable[[], object]) -> object:
        """`action()` on every rank (one_does, a barrier): a failure on any rank raises one CheckpointError on all."""

        def act() -> object:
            try:
                return action()
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException; any failed write is the same
                raise CheckpointError(f"{what} failed on rank {self.global_rank}: {root_cause(e)}; fix the storage "
                                      "(space, permissions) and resume from the last checkpoint") from e

        return one_does(act, doer=True)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if not self.distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self.finish_save()  # at most one save in flight: the one before is committed first
        final = Path(self.broadcast(str(filepath)))
        tmp = final.with_name(final.name + PARTIAL)
        zero = self.is_global_zero
        if zero and final.parent in self._saved_in and not final.parent.is_dir():  # removed during the run: said once
            rank_zero_warn(f"checkpoint folder {final.parent} was removed during the run: making it again (the "
                           "checkpoints it held are gone)")
        self._on_every_rank(f"preparing {final.parent}", lambda: zero and recover_interrupted_saves(final.parent, clean=True))
        if self.async_save and self._writer is None:  # once, on every rank: the background write's own groups
            copies = StagingOptions(use_pinned_memory=self.root_device.type == "cuda", use_shared_memory=False,
                                    use_async_staging=False, use_non_blocking_copy=False)  # copied before it returns
            self._writer = (DefaultStager(copies), dist.new_group(backend="gloo"), dist.new_group(backend="gloo"),
                            ThreadPoolExecutor(1))
        try:
            if self.async_save:
                write = self._on_every_rank(f"staging checkpoint {tmp}", lambda: self._write_async(checkpoint, tmp))
                self._in_flight = (final, write, [])
                return
            self._on_every_rank(f"writing checkpoint {tmp}", lambda: super(ModelParallel, self).save_checkpoint(checkpoint, tmp, storage_options))
            self._commit(final, f"reading back {tmp}", lambda: checksums(tmp, self._share))
        except Exception as e:
            self._failed(final, e)

    @property
    def _share(self) -> slice:
        """This rank's share of a checkpoint folder's sorted files (it reads them back, checks them at load)."""
        return slice(self.global_rank, None, self.world_size)

    def _write_async(self, checkpoint: dict, tmp: Path) -> Future:
        """Stage a copy of this rank's part of `checkpoint` (the state at this step) and write it into `tmp` in the
        background; the Future gives the CRC-32s of this rank's share of the files once every rank's are written."""
        stager, group, _, thread = self._writer
        tmp.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self.is_global_zero:
            torch.save(checkpoint, tmp / META)  # the rest, small: before the write, so done with it
        write = async_save(state, checkpoint_id=tmp, process_group=group, async_stager=stager)
        return thread.submit(lambda: (write.result(), checksums(tmp, self._share))[1])  # DCP's result: every rank's written

    def _commit(self, final: Path, what: str, share: Callable[[], dict[str, int]]) -> None:
        """Publish the written `<final>.partial` as `final` with every rank's CRC-32s (`share()`: this rank's)."""
        sums = [None] * self.world_size
        dist.all_gather_object(sums, self._on_every_rank(what, share))
        tmp = final.with_name(final.name + PARTIAL)
        self._on_every_rank(f"publishing checkpoint {final}", lambda: self.is_global_zero and publish(tmp, final, sums))
        self._saved_in.add(final.parent)

    def _failed(self, final: Path, e: Exception):
        """Every rank is here with the failure (shared): the partial goes at once, then one line."""
        tmp = final.with_name(final.name + PARTIAL)
        self._on_every_rank(f"removing {tmp}", lambda: self.is_global_zero and shutil.rmtree(tmp, ignore_errors=True))
        # a full disk or quota: named by its errno where one survives, else by what is left (torch's zip writer
        # turns a short write into "unexpected pos" with no errno)
        free, need = checkpoint_space(final.parent, self.lightning_module.config)
        if not (is_space_error(e) or free < need):
            raise e
        raise CheckpointError(
            f"no space left to save {final.name} in {final.parent} ({human_bytes(free)} free; "
            f"a checkpoint needs about {human_bytes(need)}): free space, lower save_top_k, or choose another dirpath; the "
            f"checkpoints already there are intact (resume with --ckpt_path last)") from None

    def finish_save(self, wait: bool = True) -> None:
        """Commit the save in flight (on every rank): now, or (not wait) only if every rank's write has finished."""
        if self._in_flight is None:
            return
        final, write, deferred = self._in_flight
        if not wait:
            done = torch.tensor([write.done()], dtype=torch.int32)
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._writer[2])  # a group the writes never use
            if not done.item():
                return
        self._in_flight = None
        try:
            self._commit(final, f"writing checkpoint {final.with_name(final.name + PARTIAL)}", write.result)
        except Exception as e:
            self._failed(final, e)
        for action in deferred:
            action()

    def when_committed(self, action: Callable[[], object]) -> None:
        """`action()` now, or once the save in flight is committed (never if it fails): moving last.ckpt to it,
        removing the checkpoint it replaces in the top k."""
        if self._in_flight is None:
            action()
        else:
            self._in_flight[2].append(action)

    def remove_checkpoint(self, filepath) -> None:
        self.when_committed(lambda: super(ModelParallel, self).remove_checkpoint(filepath))

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self.finish_save(wait=False)  # a step boundary: the save in flight is committed once every rank has written

    def on_exception(self, exception: BaseException) -> None:
        if self._in_flight is not None:  # a peer may be gone: no collective, no commit
            rank_zero_warn(f"checkpoint {self._in_flight[0]} was still being written when the run stopped with an error: "
                           "it is lost; --ckpt_path last resumes from the newest committed checkpoint")
            self._in_flight = None

    def on_train_end(self) -> None:  # after the callbacks' (the final step's save): every rank waits, commits
        self.finish_save()

    def teardown(self) -> None:
        try:
            self.finish_save()  # a run that ended another way (validate, an interrupted fit: nothing in flight)
        finally:
            if self._writer is not None:
                self._writer[0].close()
                self._writer[3].shutdown(wait=False)  # after an error a write may wait on a gone peer
                self._writer = None
            super().teardown()

    def lightning_module_state_dict(self) -> dict:
        if not (self.async_save and self.distributed_checkpoint):
            return super().lightning_module_state_dict()
        return get_model_state_dict(self.model)  # on the device: staged (to pinned memory on CUDA) by the save

    def optimizer_state(self, optimizer) -> dict:
        if not (self.async_save and self.distributed_checkpoint):
            return super().optimizer_state(optimizer)
        return get_optimizer_state_dict(self.model, optimizer)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(str(checkpoint_path)))
        self._on_every_rank(f"recovering {path.parent}", lambda: self.is_global_zero and recover_interrupted_saves(path.parent))
        if path.is_dir():  # a file's full tensors load as saved
            state = self.lightning_module.state_dict()  # global (unsharded) shapes, DTensor or not
            shapes = {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)}  # each rank checks its share
            one_does(lambda: check_checkpoint(path, shapes, self._share), doer=True)
        saved, optimizer = read_contents(path).optimizer, optimizer_name(self.lightning_module.hparams.get("optimizer"))
        if saved != optimizer:  # AdamW's moments are not Muon's buffers
            raise CheckpointError(f"checkpoint {path} holds model.optimizer={saved}'s state, but this run has "
                                  f"model.optimizer={optimizer}: resume with --model.optimizer {saved}, or start a new run")
        checkpoint = (self._load_file(path) if path.is_file() else super().load_checkpoint(path, weights_only=True)
                      if is_parallelized(self.model) else self._load_plain(path))
        _continue_checkpointing(self.lightning_module.trainer.checkpoint_callbacks, checkpoint, path)
        return checkpoint

    def _load_file(self, path: Path) -> dict:
        """A one-process checkpoint file: full tensors into any layout, optimizer state re-keyed by parameter name."""
        checkpoint, full = torch.load(path, mmap=True, map_location="cpu", weights_only=True), StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, checkpoint[WEIGHTS], options=full)
        names = {p: n for n, p in self.model.named_parameters()}
        for optimizer, saved in zip(self.optimizers, checkpoint[OPTIMIZERS]):
            name = {i: names[p] for group, s in zip(optimizer.param_groups, saved["param_groups"])
                    for i, p in zip(s["params"], group["params"])}
            groups = [{**g, "params": [name[i] for i in g["params"]]} for g in saved["param_groups"]]
            state = {"state": {name[i]: v for i, v in saved["state"].items()}, "param_groups": groups}
            set_optimizer_state_dict(self.model, optimizer, state, options=full)
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
