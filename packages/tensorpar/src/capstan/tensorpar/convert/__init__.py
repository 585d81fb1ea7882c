"""Slicing an existing dense model in place: `parallelize` with a plan of module-name patterns
(`apply`), and the plans for Hugging Face `transformers` families (`hf_plans`).

Built on `modules.layers` and `slicing`.
"""
