"""A training job around the engine: the `capstan train` loop (`trainer`), the run directory's lock and
resume guards (`rundir`), stopping every rank at one step boundary on a signal (`stop`), and the
mpirun command line of `capstan launch` with the status files its ranks leave (`mpirun`).
"""
