"""capstan.engine: the trainer and the `capstan` command line.

So far only `capstan info` exists (the trainer lands with the engine issue).
"""
