"""Sentence-level compression: scorers and the shared selection under a token budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "BM25Scorer",
    "EmbeddingScorer",
    "LeadScorer",
    "RandomScorer",
    "Scorer",
    "Scores",
    "SentinelCompressor",
]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.base import Scorer, Scores
    from rag_opt.compressors.baselines import BM25Scorer, EmbeddingScorer, LeadScorer, RandomScorer
    from rag_opt.compressors.sentinel import SentinelCompressor

_LAZY = {
    "Scorer": "rag_opt.compressors.base",
    "Scores": "rag_opt.compressors.base",
    "BM25Scorer": "rag_opt.compressors.baselines",
    "EmbeddingScorer": "rag_opt.compressors.baselines",
    "LeadScorer": "rag_opt.compressors.baselines",
    "RandomScorer": "rag_opt.compressors.baselines",
    "SentinelCompressor": "rag_opt.compressors.sentinel",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rag_opt.compressors' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
