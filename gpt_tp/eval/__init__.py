"""The evaluation room: HellaSwag, text samples, loss plots and the parity check (docs/structure.md)."""
