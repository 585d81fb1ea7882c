"""``python -m capstan.engine.cli ...``: the `capstan` command (how `capstan launch` starts every rank)."""

from .commands import entry

entry()
