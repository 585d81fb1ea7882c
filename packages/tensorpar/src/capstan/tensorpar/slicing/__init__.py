"""How a tensor is split over the tp group and moved between its slices: size checks, slicing and the
seeded whole-then-slice initialization (`partition`), the autograd collectives in and out of the
tensor-parallel region (`mappings`), and the dropout streams each slice draws from (`rng`).

Built on `capstan.comm` alone; `modules` and `convert` are made of these.
"""
