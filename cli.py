"""gpt_tp command line: `python cli.py fit --config configs/tp2.yaml` (see README and gpt_tp/train/cli.py).

Subcommands: fit, validate (val loss, and HellaSwag where its callback is configured), predict (continue prompts).
A user's mistake prints one line, `error: ...`, and exits with code 2 (gpt_tp.entry)."""

from gpt_tp.entry import run
from gpt_tp.perf.planner import resolve_layout
from gpt_tp.train import cli


def main(args: list[str] | None = None) -> cli.GPTCLI:
    """gpt_tp.train.cli.main with the planner for 'auto' layouts (gpt_tp.perf, a room above gpt_tp.train)."""
    return cli.main(args, plan_layout=resolve_layout)


if __name__ == "__main__":
    run(main)
