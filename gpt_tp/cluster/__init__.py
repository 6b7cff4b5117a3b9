"""The cluster room: running under Slurm (preemption, fail-fast) and a CPU run's memory placement (docs/structure.md)."""
