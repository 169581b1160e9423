"""What the framework adapters attach to each output document: rag-opt's information, JSON-serialisable.

Shared by the LangChain and LlamaIndex adapters (it imports neither framework).
"""

from __future__ import annotations

from typing import Any

from rag_opt.types import OptimizeResult, OutputDocument

__all__ = ["METADATA_KEY", "document_info"]

METADATA_KEY = "rag_opt"
"""The metadata key under which rag-opt's per-document information is stored."""


def _unit_info(out: OutputDocument) -> list[dict[str, Any]]:
    return [
        {"start": u.start, "end": u.end, "kind": u.kind, "tokens": u.tokens, "score": u.score, "kept": u.kept}
        for u in out.units
    ]


def document_info(out: OutputDocument, rank: int | None, result: OptimizeResult) -> dict[str, Any]:
    """rag-opt's information about one result document, JSON-serialisable (what goes under ``"rag_opt"``).

    ``index``: input position; ``rank``: output position (None when dropped); ``score``: document relevance
    (calibrated when ``calibrated``), ``raw_score``: before calibration; ``kept_spans``: ``[start, end]``
    character offsets of the kept text in the *original* text; ``units``: every sentence/unit with its
    offsets, score and whether it was kept; token counts in the target LLM's tokenizer.
    """
    return {
        "index": out.index,
        "rank": rank,
        "score": out.score,
        "raw_score": out.raw_score,
        "calibrated": result.calibrated,
        "scorer": result.scorer,
        "kept_spans": [[s, e] for s, e in out.kept_spans],
        "units": _unit_info(out),
        "tokens_before": out.tokens_before,
        "tokens_after": out.tokens_after,
    }
