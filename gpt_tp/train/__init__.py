"""The training room: the LightningModule, the data module, the strategy and its checkpoints, the optimizer
schedule, progress, prediction, Slurm preemption and the export command."""
