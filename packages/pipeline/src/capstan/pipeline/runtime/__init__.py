"""Running a schedule across ranks: the executor that interprets one stage's instructions with real
tensors (`executor`), and the point-to-point transport of activations and gradients with their shape
headers (`transport`).

Built on `schedule`, `stages` and `capstan.comm`.
"""
