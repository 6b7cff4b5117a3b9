"""The command-line room: cli.py's parser and checks, --simulate, the planner and parity commands (docs/structure.md)."""
