"""The evaluation room: HellaSwag (hellaswag.py: callback and command; hellaswag_data.py: the file;
hellaswag_score.py: the scoring), text samples (sampling.py), the padded vocabulary (vocab.py) and the loss plot."""
