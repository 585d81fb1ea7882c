"""The model states an `Engine` trains, behind one interface (base.py): flat ZeRO 0-2 buffers (flat.py)
or chunkmem's chunks (chunked.py). The engine runs the step's three calls, the pipeline and the loops;
everything that depends on where the parameters, gradients and Adam moments live is here."""

from .base import ModelStates, overflowed
from .chunked import ChunkedStates
from .flat import FlatStates

__all__ = ["ModelStates", "FlatStates", "ChunkedStates", "overflowed"]
