"""The `capstan` command line (`main`): ``train``, ``info``, ``launch`` (`launch`), ``checkpoint
inspect|export`` and ``bench-disk`` (`capstan.engine.machine.disk_bench`). ``python -m capstan.engine.cli``
runs it too."""

from .commands import EXIT_BAD_INPUT, build_parser, entry, main

__all__ = ["EXIT_BAD_INPUT", "build_parser", "entry", "main"]
