"""gpt_tp command line: `python cli.py fit --config configs/tp2.yaml` (see README and gpt_tp/cli/main.py).

Subcommands: fit, validate (val loss, and HellaSwag where its callback is configured), predict (continue prompts).
A user's mistake prints one line, `error: ...`, and exits with code 2 (gpt_tp.entry)."""

from gpt_tp.entry import run
from gpt_tp.cli.main import main

if __name__ == "__main__":
    run(main)
