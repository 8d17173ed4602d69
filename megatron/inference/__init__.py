"""Inference on one process: a whole model from a checkpoint of any layout (loading.py), text
generation (sampling.py, text_generation.py), and evaluation (evaluation.py, harness.py)."""
