"""Rank-aware logging: every line says which rank (and which dp/pp/tp coordinate) wrote it.

Use `get_logger(__name__)` everywhere; `log_rank0` for messages every rank
would repeat; `warn_once` for notices that would otherwise flood a loop.
Setting ``CAPSTAN_DEBUG_COMM=1`` makes every capstan collective log its
duration and size (see `collectives.py`).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger", "log_rank0", "warn_once", "set_rank_context", "rank_prefix", "debug_comm"]

_context: dict[str, object] = {"rank": None, "coords": None}
_warned: set[str] = set()


def set_rank_context(rank: int | None, coords: tuple[int, ...] | None = None) -> None:
    """Record this process's global rank and (dp, pp, tp[, cp]) coordinates for log prefixes."""
    _context["rank"] = rank
    _context["coords"] = coords


def rank_prefix() -> str:
    """`rank 3 1/0/1` (rank, then dp/pp/tp, and /cp where there is a cp axis) or `rank 3` before a
    topology exists."""
    rank = _context["rank"]
    if rank is None:
        return "rank -"
    coords = _context["coords"]
    if coords is None:
        return f"rank {rank}"
    return f"rank {rank} " + "/".join(map(str, coords))  # type: ignore[call-overload]


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = rank_prefix()
        return True


def _configure_root() -> logging.Logger:
    root = logging.getLogger("capstan")
    if not getattr(root, "_capstan_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[%(rank_prefix)s] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("CAPSTAN_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        root._capstan_configured = True  # type: ignore[attr-defined]
    return root


def get_logger(name: str) -> logging.Logger:
    """A logger under the `capstan` hierarchy whose lines carry the rank prefix."""
    _configure_root()
    if name != "capstan" and not name.startswith("capstan."):
        name = f"capstan.{name}"
    return logging.getLogger(name)


def log_rank0(logger: logging.Logger, msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log only on global rank 0 (or when no rank is known yet)."""
    if _context["rank"] in (None, 0):
        logger.log(level, msg, *args)


def warn_once(logger: logging.Logger, msg: str, *args: object) -> None:
    """Warn the first time this exact message is seen in this process."""
    key = msg % args if args else msg
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def debug_comm() -> bool:
    """True when CAPSTAN_DEBUG_COMM asks for per-collective timing."""
    return os.environ.get("CAPSTAN_DEBUG_COMM", "") not in ("", "0")
