"""The command-line room: cli.py's parser and checks, --simulate and the planner command (docs/structure.md)."""
