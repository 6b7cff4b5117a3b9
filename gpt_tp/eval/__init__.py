"""The evaluation room: HellaSwag (hellaswag.py: callback and command; hellaswag_data.py: the file;
hellaswag_score.py: the scoring), text samples (sampling.py), the loss plot (plot.py) and the parity check of a
tensor-parallel plan against one device (paritycheck.py). The padded vocabulary's mask: gpt_tp.parallel.vocab."""
