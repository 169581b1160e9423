"""Lazy attribute loading for package ``__init__`` modules (PEP 562): heavy modules load on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_module"]


def lazy_module(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` that import ``names[attr]`` (a module path) on demand."""

    def __getattr__(attr: str) -> Any:
        module = names.get(attr)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {attr!r}")
        return getattr(importlib.import_module(module), attr)

    def __dir__() -> list[str]:
        return sorted(set(names) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
