"""Several runs in one launch: a worker's command line cut at each `--then` into one argument list per run."""

import importlib
import sys

import torch.distributed as dist


def split_runs(argv: list[str] | None = None) -> list[list[str]]:
    runs = [[]]
    for a in sys.argv[1:] if argv is None else argv:
        if a == "--then":
            runs.append([])
        else:
            runs[-1].append(a)
    return runs


def run_all(one_run) -> None:
    """one_run(argv) for each run of the command line, one after another; a run that starts with `--worker NAME` is
    tests/workers/NAME.py's one_run (muon_parity.py's and parity.py's runs in one launch). Then the group ends."""
    for argv in split_runs():
        if argv[:1] == ["--worker"]:
            importlib.import_module(argv[1]).one_run(argv[2:])
        else:
            one_run(argv)
    dist.destroy_process_group()
