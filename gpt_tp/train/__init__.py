"""The training room: Lightning, checkpoints, Slurm and the training commands (docs/structure.md)."""
