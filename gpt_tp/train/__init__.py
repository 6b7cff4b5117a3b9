"""The training room: the LightningModule, its step, data, logs and callbacks; a run's plot (docs/structure.md)."""
