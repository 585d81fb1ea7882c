"""Optimizers over chunks: Adam on the native CPU kernel (adam.py), the step overlapped with backward
(overlap.py), 1-bit Adam's compressed step (onebit.py), and fp16's dynamic loss scaling (precision.py)."""
