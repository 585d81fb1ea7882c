"""What a model's parameters become: chunks and their states (chunk.py, states.py), how parameters are packed
into them (layout.py, order.py), the module hooks that make chunks resident around compute (hooks.py,
saved.py), `ChunkedModel` itself (chunked.py) and the least budget it needs (budget.py), and per-parameter
state reads and writes for checkpoints (state_io.py)."""
