"""OpenAI-compatible proxy: optimizes the retrieved context inside chat requests and forwards them upstream.

``rag-opt serve --upstream URL`` runs it; :func:`create_app` builds the ASGI app (needs the ``server`` extra:
``pip install 'rag-opt[server]'``). Nothing heavy is imported until used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ProxySettings", "create_app"]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.adapters.proxy.app import create_app
    from rag_opt.adapters.proxy.settings import ProxySettings

_LAZY = {"create_app": "rag_opt.adapters.proxy.app", "ProxySettings": "rag_opt.adapters.proxy.settings"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rag_opt.adapters.proxy' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
