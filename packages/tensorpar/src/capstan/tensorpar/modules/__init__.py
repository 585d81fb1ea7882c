"""The tensor-parallel modules: column/row-parallel linears, the vocabulary-parallel embedding and norms
(`layers`), attention and MLP blocks (`blocks`), the vocabulary-parallel cross-entropy
(`cross_entropy`), the head and loss in sequence tiles (`tiled_loss`) and the reference GPT (`gpt`).

Built on `slicing` and `context` (attention across a split sequence).
"""
