"""Scoring a context in two document orders (opt-in): the second forward pass reads the documents reversed.

The proxy's attention depends on where a document sits: the first slots of a long context carry the attention
sink, and the document probe reads them least reliably (at 30 documents the gold passage in slot 1 is found less
often than BM25 finds it). Reading the context a second time with the documents in reverse order puts every
document in a second slot — the first one last — and the two readings are averaged in log-odds, unit by unit and
document by document. It costs a second forward pass; :class:`~rag_opt.compressors.SentinelCompressor` does it
with ``passes=2``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rag_opt.text.units import UnitTable

__all__ = ["mean_log_odds", "reversed_documents", "to_original"]

_CLIP = 1e-6


def reversed_documents(units: UnitTable) -> tuple[UnitTable, np.ndarray]:
    """``units`` with its documents in reverse order (each document's own rows unchanged), and for each row of
    the reversed table the row of ``units`` it came from (:func:`to_original` maps values back)."""
    n = units.n_docs
    pieces = [np.asarray(units.rows(d), dtype=np.int64) for d in reversed(range(n))]
    rows = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def pick(values: tuple[object, ...]) -> tuple[object, ...]:
        return tuple(values[::-1]) if values else values

    new_row = np.empty(len(rows), dtype=np.int64)
    new_row[rows] = np.arange(len(rows))

    def moved(links: np.ndarray | None) -> np.ndarray | None:
        """A column of row links (-1: none) with its rows and the rows it points to moved."""
        if links is None:
            return None
        taken = links[rows]
        return np.where(taken >= 0, new_row[np.maximum(taken, 0)], -1).astype(np.int64)

    table = replace(
        units,
        doc=(n - 1 - units.doc[rows]).astype(np.int64),
        start=units.start[rows],
        end=units.end[rows],
        kind=tuple(units.kind[r] for r in rows),
        tokens=units.tokens[rows],
        candidate=units.candidate[rows],
        texts=tuple(units.texts[r] for r in rows),
        documents=pick(units.documents),  # type: ignore[arg-type]
        titles=pick(units.titles),  # type: ignore[arg-type]
        title_sources=pick(units.title_sources),  # type: ignore[arg-type]
        link_names=pick(units.link_names),  # type: ignore[arg-type]
        link_variants=pick(units.link_variants),  # type: ignore[arg-type]
        link_spans=pick(units.link_spans),  # type: ignore[arg-type]
        title_tokens=None if units.title_tokens is None else units.title_tokens[::-1].copy(),
        text_tokens=None if units.text_tokens is None else units.text_tokens[::-1].copy(),
        parent=moved(units.parent),
        closer=moved(units.closer),
        comma=None if units.comma is None else units.comma[rows],
    )
    return table, rows


def to_original(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per-row values of the reversed table (:func:`reversed_documents`) put back in the original rows."""
    out = np.empty_like(np.asarray(values))
    out[rows] = values
    return out


def mean_log_odds(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The probability whose log-odds is the mean of those of ``p`` and ``q`` (element-wise)."""
    a = np.clip(np.asarray(p, dtype=np.float64), _CLIP, 1 - _CLIP)
    b = np.clip(np.asarray(q, dtype=np.float64), _CLIP, 1 - _CLIP)
    z = 0.5 * (np.log(a / (1 - a)) + np.log(b / (1 - b)))
    return np.asarray(1.0 / (1.0 + np.exp(-z)), dtype=np.float64)
