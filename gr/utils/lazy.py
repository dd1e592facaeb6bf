"""Lazy public names for packages whose imports are heavy (torch, TorchRec, Lightning)."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Mapping


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: name -> ``getattr(import_module(exports[name]), name)``.

    exports: {public name: the module that defines it}; the module is imported on first access.
    """

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
