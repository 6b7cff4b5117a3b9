"""benchmarks.audit's runs of one world size in one launch: their argument lists joined by `--then` (`--layers 3
--json a.json --then --dp 2 --json b.json`), each run the command's main as `python -m benchmarks.audit` runs it, one
after another in the same process group (each seeds and builds its step afresh). Exits 1 when any run's measurement
differs from the model, as the command does."""

from benchmarks.audit import main as audit
from gpt_tp.entry import run
from runs import split_runs


def main() -> int:
    return max([audit(argv) for argv in split_runs()])


if __name__ == "__main__":
    run(main)
