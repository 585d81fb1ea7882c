"""A package's names imported on first use (PEP 562), so that importing one light module of a package
does not run every heavy import its ``__init__`` would make.

Why: ``capstan launch`` needs only torch-free modules (``capstan.comm.job.launch_env``, the engine's config
and ``capstan.engine.plan.spec``), yet importing any of them runs its package's ``__init__``; with eager
re-exports that imported torch, 1.4 s before every job on a 2-core machine. The packages whose
``__init__`` re-exports torch-backed names (comm, engine, engine.plan) map each name to its module::

    _LAZY = {"all_reduce": "collectives", ...}
    __getattr__ = lazy_attributes(__name__, _LAZY)
    __all__ = sorted(_LAZY)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of `package`: name -> getattr(its submodule modules[name], name),
    imported once and then kept as a plain attribute of the package.

    No name may be a submodule's name too: importing that submodule (``from .search import ...``
    anywhere) binds the package attribute to the module, and ``__getattr__`` is never asked again, so
    ``pkg.search(...)`` would call a module (why comm's device.py is accelerator.py, plan's search.py
    is layout_search.py, and comm's rooms are job/ and backends/, not world/ and transport/). A module
    in a subpackage ("job.state") clashes through each part of its path."""
    clash = sorted(set(modules) & {part for module in modules.values() for part in module.split(".")})
    if clash:
        raise ImportError(f"{package}: {clash} name both an exported attribute and a submodule")

    def __getattr__(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{modules[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
