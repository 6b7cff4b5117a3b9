"""How every gpt_tp command starts and ends: a user's mistake is one ``error:`` line, once per run, and exit code 2;
a distributed process leaves through os._exit (docs/scale.md, "How a distributed command exits")."""

import argparse
import errno
import hashlib
import logging
import os
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from gpt_tp.errors import UserError
from gpt_tp.ranks import Layout, build_mesh

EXIT_USER_ERROR = 2  # argparse's code for a bad command line; used for every user mistake


class ArgumentParser(argparse.ArgumentParser):
    """Every gpt_tp command's parser: a bad flag is a UserError, one ``error:`` line from `run`, not a usage block."""

    def __init__(self, prog: str, description: str | None = None, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(prog=prog, description=description, **kwargs)

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def torchrun_world() -> int:
    """The number of processes torchrun started; outside torchrun a UserError says how to launch."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError("run this command under torchrun, e.g. python -m torch.distributed.run --standalone "
                        "--nproc_per_node=2 -m <command> ...")
    return int(os.environ["WORLD_SIZE"])


def pick_device(device: str = "auto"):
    """A --device value ("auto": CUDA when present) as this process's torch.device (CUDA: its LOCAL_RANK's GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch finds no CUDA device on this machine; use --device cpu, or auto (CUDA "
                        "when present)")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")


def torchrun_mesh(dp: int, tp: int, device: str = "auto"):
    """(the (data_parallel, tensor_parallel) DeviceMesh, torch.device) of a command torchrun started: NCCL or gloo."""
    world = torchrun_world()
    if dp * tp != world:
        raise UserError(f"data-parallel {dp} x tensor-parallel {tp} = {dp * tp} processes, but torchrun started "
                        f"{world}: pass --nproc_per_node={dp * tp} or change the layout")
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return build_mesh(Layout(dp, tp), dev.type), dev


def report(message: str) -> None:
    """Print ``error: message`` on stderr once per run: by the first process to claim it under a key of the run's
    rendezvous store (torchrun's agent, or rank 0's), which ends with the run; where no store answers, by rank 0."""
    # the group's size first: Lightning's teardown, before this, removes WORLD_SIZE but keeps the group
    world = dist.get_world_size() if dist.is_initialized() else os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS"))
    if int(world or 1) > 1 and "MASTER_PORT" in os.environ:
        key = "gpt_tp/error/" + hashlib.sha1(message.encode()).hexdigest()
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))
        try:
            store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timedelta(seconds=5))
            first = store.add(key, 1) == 1
        except (RuntimeError, OSError, ValueError):  # no store yet, or gone with rank 0 (who printed, if it had it)
            first = int(rank) == 0
        if not first:
            return
    print(f"error: {message}", file=sys.stderr, flush=True)


USER_ERRORS = (UserError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a full disk, a quota, a read-only file system


def _mistake(e: BaseException | None) -> str | None:
    """One line for the user's mistake or storage fault that `e` is or was raised from (jsonargparse wraps one raised
    while it builds a config's class in its own ValueError); None for a bug."""
    while e is not None and not (isinstance(e, USER_ERRORS) or getattr(e, "errno", None) in STORAGE_ERRNOS):
        e = e.__cause__ or e.__context__
    if e is None:
        return None
    if getattr(e, "errno", None) in STORAGE_ERRNOS and not isinstance(e, UserError):
        where = f"writing {e.filename}" if getattr(e, "filename", None) else "writing"
        fix = "remount it read-write" if e.errno == errno.EROFS else "free space (or the quota)"
        text = f"{e.strerror} while {where}; {fix}, or write to another folder"
    else:
        text = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())


def run(main: Callable[[], object]) -> None:
    """Run a command's ``main`` and exit: 0 (or main's int), 2 and one line for a user's mistake, 1 and a traceback."""
    warnings.formatwarning = lambda message, category, *_: f"{category.__name__}: {message}\n"  # no file, no source line
    try:
        result = main()
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USER_ERROR)
        if isinstance(e.code, str):  # argparse/jsonargparse already printed; sys.exit("message") did not
            report(e.code.removeprefix("error: "))
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:
        if (mistake := _mistake(e)) is not None:
            report(mistake)
            code = EXIT_USER_ERROR
        else:  # a bug: its traceback
            sys.excepthook(type(e), e, e.__traceback__)
            code = 1
    _leave(code)


def _leave(code: int) -> None:
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized and "RANK" not in os.environ:  # never distributed (torchrun sets RANK; a command may have
        sys.exit(code)  # destroyed its group itself, which leaves the threads of a mesh's groups running)
    if initialized and (code == 0 or dist.get_world_size() == 1):
        # after an error a peer may still be inside a collective: joining the group could wait for its timeout
        dist.destroy_process_group()  # while Python is fully alive: joins gloo's threads, stops NCCL's watchdog
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
