"""The inference room: text generation, TP-aware, and cli.py predict's prompts and writer (docs/structure.md)."""
