"""The proxy language model: where it comes from, loading it, its prompt, and reading its attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "AttentionFeatures",
    "ModelSource",
    "ProxyModel",
    "extract",
    "load_proxy_model",
    "resolve_source",
]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.extract import AttentionFeatures, extract
    from rag_opt.models.loader import ProxyModel, load_proxy_model
    from rag_opt.models.sources import DEFAULT_MODEL, EMBEDDED_MODELS, ModelSource, resolve_source

__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "AttentionFeatures": "rag_opt.models.extract",
        "extract": "rag_opt.models.extract",
        "ProxyModel": "rag_opt.models.loader",
        "load_proxy_model": "rag_opt.models.loader",
        "DEFAULT_MODEL": "rag_opt.models.sources",
        "EMBEDDED_MODELS": "rag_opt.models.sources",
        "ModelSource": "rag_opt.models.sources",
        "resolve_source": "rag_opt.models.sources",
    },
)
