"""The cluster room: running under Slurm: preemption, fail-fast, the newest checkpoint (docs/structure.md)."""
