"""Why each unit was kept or dropped: the per-unit record of one optimization, bounded in size.

The select stage records each decision where it makes it (:attr:`rag_opt.compressors.selection.Selection.reasons`)
and the render stage puts it on every :class:`~rag_opt.types.Unit` of the result (``reason``, ``rank``,
``needed_by``, ``scored_by``). :func:`explain_result` lists them per document, in input order, at most
``max_units`` units in all: the library's explanation of a result, what ``explain: true`` adds to a
``/v1/compress`` answer, and what the ``rag-opt explain`` HTML report shows (:mod:`rag_opt.report`): one source.

:data:`REASONS` says each reason in words (``docs/python-api.md`` has the same table).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from rag_opt.errors import InvalidInputError
from rag_opt.types import MAX_EXPLAINED_UNITS, OptimizeResult, Unit

__all__ = [
    "MAX_EXPLAINED_UNITS",
    "REASONS",
    "ExplainedDocument",
    "Explanation",
    "describe",
    "explain_result",
]

REASONS: dict[str, str] = {
    # kept
    "selected": "kept by its score, within the budget",
    "fill": "kept by the last pass, in the budget the rendered documents left",
    "required": "kept whatever the budget: the best unit of a document marked required",
    "floor": "kept whatever the budget: the context's best unit, so that the context is not emptied",
    "first": "kept as its document's first unit (keep_first)",
    "best_of_document": "kept as its document's best unit that fits (keep_best_per_doc)",
    "antecedent": "kept as the antecedent of a kept sentence that leans on it (It, These, 'than that', ...)",
    "title": "kept as the title of a document that keeps text",
    "heading": "kept as the heading of a kept unit (a title/heading row)",
    "structure": "kept as protected structure around a kept unit (JSON brackets or key, a table header, a code fence)",
    "no_compression": "kept: nothing was compressed (no budget, or the budget holds the whole context)",
    # dropped
    "budget": "dropped: it did not fit what was left of the budget",
    "recount": "dropped when the kept text was counted again and exceeded the budget (the lowest score goes first)",
    "below_threshold": "dropped: its score is below the threshold",
    "document_below_best": "dropped with its document, whose relevance is far below the best's (drop_below_best)",
    "unused": "dropped: a title/heading or structure row that no kept unit needs",
}

_BY_SCORE = frozenset({"selected", "fill", "budget", "recount", "below_threshold", "first", "best_of_document"})


def describe(unit: Unit) -> str:
    """``unit``'s reason in words, naming a lexical-tier decision (a unit scored by the lexical probe)."""
    if unit.reason is None:
        return "kept" if unit.kept else "dropped"
    words = REASONS[unit.reason]
    if unit.scored_by == "lexical-probe" and unit.reason in _BY_SCORE:
        words += " (a lexical-tier decision: scored by the lexical probe)"
    return words


class ExplainedDocument(BaseModel):
    """One input document and its units, as the select stage decided them."""

    index: int = Field(description="its position in the input")
    id: str = Field(description="the input id, or the input index as a string")
    title: str | None = Field(default=None, description="the title rag-opt read")
    kept: bool = Field(description="the document keeps some text")
    position: int | None = Field(default=None, description="its position in the output (null: dropped)")
    tokens_before: int = 0
    tokens_after: int = 0
    units_total: int = Field(description="how many units its text has")
    units: list[Unit] = Field(
        description="its units in text order (character span into the input text, kept, score, rank, reason, "
        "needed_by: an index into this list), all of them unless the explanation's max_units cut the list"
    )


class Explanation(BaseModel):
    """Per document (input order), each unit with why it was kept or dropped; at most ``max_units`` listed."""

    documents: list[ExplainedDocument]
    units_total: int = Field(description="units of every document")
    units_listed: int = Field(description="units listed (units_total unless truncated)")
    truncated: bool = Field(description="the list stops at max_units: later units are counted, not listed")
    max_units: int | None = Field(description="the most units listed (null: no bound)")
    reasons: dict[str, int] = Field(description="how many units had each reason (listed or not)")


def explain_result(result: OptimizeResult, *, max_units: int | None = MAX_EXPLAINED_UNITS) -> Explanation:
    """``result``'s documents in input order, each with its units and why (see the module docstring): documents
    are listed in input order until ``max_units`` units are listed (None: all)."""
    if max_units is not None and (isinstance(max_units, bool) or not isinstance(max_units, int) or max_units < 0):
        raise InvalidInputError(f"max_units must be a non-negative integer or None, got {max_units!r}")
    position = {d.index: i for i, d in enumerate(result.documents)}
    left = max_units
    documents: list[ExplainedDocument] = []
    counts: dict[str, int] = {}
    for doc in sorted([*result.documents, *result.dropped], key=lambda d: d.index):
        listed = doc.units if left is None else doc.units[:left]
        if left is not None:
            left -= len(listed)
        for u in doc.units:
            key = u.reason or ("kept" if u.kept else "dropped")
            counts[key] = counts.get(key, 0) + 1
        documents.append(
            ExplainedDocument(
                index=doc.index,
                id=doc.id,
                title=doc.title,
                kept=doc.index in position,
                position=position.get(doc.index),
                tokens_before=doc.tokens_before,
                tokens_after=doc.tokens_after,
                units_total=len(doc.units),
                units=list(listed),
            )
        )
    total = sum(d.units_total for d in documents)
    listed_n = sum(len(d.units) for d in documents)
    return Explanation(
        documents=documents,
        units_total=total,
        units_listed=listed_n,
        truncated=listed_n < total,
        max_units=max_units,
        reasons=counts,
    )
