"""The evaluation room: HellaSwag, text samples and the loss plot."""
