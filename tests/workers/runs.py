"""Several runs in one launch: a worker's command line cut at each `--then` into one argument list per run."""

import sys


def split_runs(argv: list[str] | None = None) -> list[list[str]]:
    runs = [[]]
    for a in sys.argv[1:] if argv is None else argv:
        if a == "--then":
            runs.append([])
        else:
            runs[-1].append(a)
    return runs
