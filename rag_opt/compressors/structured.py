"""Scoring the rows of structured blocks: JSON items, table rows and code lines read by their lexical match.

A small proxy model's attention does not single out one record among hundreds of near-identical ones (in a
300-row table its question attends mostly to the last rows), while the record's identifiers (``item 42``) match
the question word for word. So a candidate unit inside a structured block (a row with an opener:
:attr:`rag_opt.text.units.UnitTable.parent`) scores its lexical-probe score
(:class:`~rag_opt.compressors.lexical_scorer.LexicalScorer`: BM25 and term overlap, no model, milliseconds);
prose keeps its proxy score. The rows' proxy scores are not used: they cannot tell one record from the next, and a
probe trained on prose may be sure of every row alike (a hidden-layer probe scored all 60 records of a JSON list
0.96-0.99, so the better of the two scores kept the wrong record: ``docs/research-log.md``). A row's lexical
features read every term, single characters too, and pairs of adjacent terms
(:data:`rag_opt.compressors.lexical.RECORD_TERMS`: ``item 3`` is named by its ``3``, and ``item 26`` outranks a row
priced ``26.00``), and carry no position prior (no row is a lead sentence):
:func:`rag_opt.compressors.features.lexical_features`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rag_opt.text.units import UnitTable

__all__ = ["structured_rows", "with_lexical_rows"]


def structured_rows(units: UnitTable) -> np.ndarray:
    """Per row: a candidate inside a structured block (it has an opener)."""
    if units.parent is None:
        return np.zeros(units.n_units, dtype=bool)
    return np.asarray(units.candidate & (units.parent >= 0), dtype=bool)


def with_lexical_rows(unit: np.ndarray, units: UnitTable, lexical: Callable[[], np.ndarray]) -> np.ndarray:
    """``unit`` scores with every structured row's score replaced by its lexical score; ``lexical`` gives the
    lexical scores of all rows (called only when the table has structured rows)."""
    rows = structured_rows(units)
    if not rows.any():
        return unit
    out = np.asarray(unit, dtype=np.float64).copy()
    out[rows] = np.asarray(lexical(), dtype=np.float64)[rows]
    return out
