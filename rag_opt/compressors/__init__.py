"""Sentence-level compression: the *score* stage (scorers) and the *select* stage (selection under a budget)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = [
    "BM25Scorer",
    "EmbeddingScorer",
    "LeadScorer",
    "RandomScorer",
    "Scorer",
    "Scores",
    "Selection",
    "SelectionOptions",
    "SentinelCompressor",
    "select",
]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.base import Scorer, Scores
    from rag_opt.compressors.baselines import BM25Scorer, EmbeddingScorer, LeadScorer, RandomScorer
    from rag_opt.compressors.selection import Selection, SelectionOptions, select
    from rag_opt.compressors.sentinel import SentinelCompressor

__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "Scorer": "rag_opt.compressors.base",
        "Scores": "rag_opt.compressors.base",
        "BM25Scorer": "rag_opt.compressors.baselines",
        "EmbeddingScorer": "rag_opt.compressors.baselines",
        "LeadScorer": "rag_opt.compressors.baselines",
        "RandomScorer": "rag_opt.compressors.baselines",
        "Selection": "rag_opt.compressors.selection",
        "SelectionOptions": "rag_opt.compressors.selection",
        "select": "rag_opt.compressors.selection",
        "SentinelCompressor": "rag_opt.compressors.sentinel",
    },
)
