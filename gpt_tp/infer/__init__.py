"""The inference room: TP-aware text generation for cli.py predict and for samples in training (docs/structure.md)."""
