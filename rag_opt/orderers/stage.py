"""The *order* stage as the pipeline runs it: what an orderer is given, built from the earlier stages' values."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt.orderers.base import Orderer, Ordering, OrderItem

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.base import Scores
    from rag_opt.compressors.selection import Selection
    from rag_opt.text.units import UnitTable

__all__ = ["order_stage"]


def order_stage(
    query: str, orderer: Orderer, units: UnitTable, scores: Scores | None, selection: Selection
) -> Ordering:
    """The order stage: the kept documents (their text as the LLM reads it, and their relevance) through the
    orderer; fewer than two, or the identity ordering, need no work."""
    kept = selection.kept_docs
    if len(kept) < 2 or not orderer.reorders:
        return Ordering(list(range(len(kept))))
    items = []
    for rank, d in enumerate(kept):
        text = units.documents[d].text if selection.keep[list(units.rows(d))].all() else selection.texts[d]
        title = units.titles[d] if not units.title_in_text(d) else None  # a heading line is in the text already
        items.append(OrderItem(f"{title}\n{text}" if title else text, _relevance(units, scores, d, rank)))
    return orderer.order(query, items)


def _relevance(units: UnitTable, scores: Scores | None, d: int, rank: int) -> float:
    """Document relevance for ordering: rag-opt's score, else the retriever's, else input order."""
    if scores is not None:
        return float(scores.doc[d])
    retriever = units.documents[d].score
    return retriever if retriever is not None else -float(rank)
