"""Cutting a model into stages: layer specs, balanced cuts by parameters or measured time, tied layers
(`partition`), and the layer list of a Hugging Face `transformers` model (`hf_layers`).
"""
