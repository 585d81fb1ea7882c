"""The transports beneath the collectives that torch.distributed does not give us as we need them: mpi4py
(mpi_backend, any tensor size and non-blocking operations on one communicator) and gloo's missing
reduce-scatter (gloo_reduce_scatter, a ring of point-to-point rounds).

Imports only `job` (the world's state and groups); `ops` chooses among them.
"""
