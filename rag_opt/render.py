"""The *render* stage: the unit table, scores, selection and ordering become the :class:`OptimizeResult`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rag_opt.types import OptimizeResult, OrderingName, OutputDocument, Timings, Unit

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.base import Scores
    from rag_opt.compressors.selection import Selection
    from rag_opt.text.units import UnitTable

__all__ = ["render_result"]


def render_result(
    query: str,
    units: UnitTable,
    scores: Scores | None,
    selection: Selection,
    permutation: Sequence[int],
    *,
    ordering: OrderingName,
    tier: str,
    token_budget: int | None,
    target_tokenizer: str,
    timings: Timings,
    warnings: list[str],
    placement_profile: str | None = None,
) -> OptimizeResult:
    """Build the result: kept documents in ``permutation`` order (indices into the kept documents), dropped ones
    after, each with its kept spans, unit scores and token counts."""
    kept = selection.kept_docs
    out = [_document(units, scores, selection, d) for d in range(units.n_docs)]
    documents = [out[kept[j]] for j in permutation]
    tokens_after = sum(doc.tokens_after for doc in documents)
    over = selection.over_budget  # a unit kept whole rather than empty the context (selection says so)
    if token_budget is not None and tokens_after > token_budget + over:  # pragma: no cover - guarded by selection
        raise AssertionError(f"selection exceeded the budget: {tokens_after} > {token_budget}")
    return OptimizeResult(
        query=query,
        documents=documents,
        dropped=[out[d] for d in range(units.n_docs) if not selection.doc_kept[d]],
        tokens_before=units.tokens_before,
        tokens_after=tokens_after,
        token_budget=token_budget,
        over_budget=over,
        target_tokenizer=target_tokenizer,
        scorer=scores.method if scores is not None else "none",
        proxy_model=scores.model if scores is not None else None,
        calibrated=scores.calibrated if scores is not None else False,
        ordering=ordering,
        tier=tier if scores is not None else "none",  # type: ignore[arg-type]
        timings=timings,
        warnings=[*warnings, *selection.warnings],
        placement_profile=placement_profile,
        **_reading(scores),
    )


def _reading(scores: Scores | None) -> dict[str, Any]:
    """How the proxy read the context, when a proxy pass ran (its encoding and cache use)."""
    attn = scores.attention if scores is not None else None
    if attn is None:
        return {}
    return {"encoding": attn.encoding, "cache_hits": attn.cache_hits, "cache_misses": attn.cache_misses}


def _document(units: UnitTable, scores: Scores | None, selection: Selection, d: int) -> OutputDocument:
    source = units.documents[d]
    rows = [r for r in units.rows(d) if units.start[r] >= 0]  # the text's units (not the title line)
    keep = selection.keep
    whole = all(keep[r] for r in rows)
    assert units.title_tokens is not None and units.text_tokens is not None
    return OutputDocument(
        id=source.id if source.id is not None else str(d),
        index=d,
        text=(source.text if whole else selection.texts[d]) if selection.doc_kept[d] else "",
        metadata=source.metadata,
        title=units.titles[d],
        title_source=units.title_sources[d] if units.title_sources else None,
        score=float(scores.doc[d]) if scores is not None else None,
        raw_score=_raw_score(scores, d),
        retriever_score=source.score,
        kept_spans=units.kept_spans(d, keep),
        units=_units(units, scores, selection, rows),
        tokens_before=int(units.title_tokens[d] + units.text_tokens[d]),
        tokens_after=int(selection.tokens_after[d]),
    )


def _units(units: UnitTable, scores: Scores | None, selection: Selection, rows: list[int]) -> list[Unit]:
    """The text's units of one document (``rows``), with their scores and the select stage's decisions: kept or
    not, the rank they were tried in, why, and the unit (an index into this list) a unit was kept with."""
    keep, reasons, rank, by = selection.keep, selection.reasons, selection.rank, selection.needed_by
    index = {r: i for i, r in enumerate(rows)}
    return [
        Unit(
            start=int(units.start[r]),
            end=int(units.end[r]),
            kind=units.kind[r],
            tokens=int(units.tokens[r]),
            score=float(scores.unit[r]) if scores is not None else None,
            kept=bool(keep[r]),
            rank=int(rank[r]) if rank is not None and rank[r] > 0 else None,
            reason=reasons[r] if reasons else None,
            needed_by=index.get(int(by[r])) if by is not None and by[r] >= 0 else None,
            scored_by=scores.scored_by(r) if scores is not None else None,
        )
        for r in rows
    ]


def _raw_score(scores: Scores | None, d: int) -> float | None:
    if scores is None:
        return None
    return float(scores.doc_raw[d]) if scores.doc_raw is not None else float(scores.doc[d])
