"""The command-line room: cli.py's parser and checks before launch, --simulate and the planner command
(docs/structure.md)."""
