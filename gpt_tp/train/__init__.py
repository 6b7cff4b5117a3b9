"""The training room: the LightningModule, the data module, the strategy and its checkpoints, the optimizer
schedule, progress, prediction, Slurm preemption, the CPU allocator callback (malloc.py), and the export and layout
planner (plan.py) commands."""
