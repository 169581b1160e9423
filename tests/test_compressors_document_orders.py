"""Scoring in two document orders (``SentinelCompressor(passes=2)``): the reversed reading and how it is merged."""

from __future__ import annotations

import numpy as np
import pytest

from rag_opt.compressors.document_orders import mean_log_odds, reversed_documents, to_original
from rag_opt.errors import InvalidInputError
from rag_opt.text.tokens import get_token_counter
from rag_opt.text.units import UnitTable
from rag_opt.types import Document
from tests.helpers import hotpot_dev, hotpot_docs


def _example() -> dict:
    return hotpot_dev(1)[0]


def _table(n: int = 4) -> UnitTable:
    counter = get_token_counter("gpt-4o")
    return UnitTable.build([Document(**d) for d in hotpot_docs(_example())[:n]], counter.count)


def test_the_reversed_table_holds_the_same_rows_with_the_documents_in_reverse_order():
    units = _table()
    rev, rows = reversed_documents(units)
    assert rev.by_document() == units.by_document()[::-1]
    assert [d.text for d in rev.documents] == [d.text for d in units.documents][::-1]
    assert list(rev.titles) == list(units.titles)[::-1]
    assert rev.tokens_before == units.tokens_before
    np.testing.assert_array_equal(rev.title_tokens, units.title_tokens[::-1])
    # every row is the original row it came from, and reversing twice gives the table back
    assert [rev.texts[i] for i in range(rev.n_units)] == [units.texts[r] for r in rows]
    np.testing.assert_array_equal(rev.tokens, units.tokens[rows])
    np.testing.assert_array_equal(rev.candidate, units.candidate[rows])
    back, rows_back = reversed_documents(rev)
    assert back.texts == units.texts and np.array_equal(back.doc, units.doc)
    values = np.arange(units.n_units, dtype=float)
    np.testing.assert_array_equal(to_original(values[rows], rows), values)
    # rendering a reversed document gives the original document's text
    keep = np.ones(rev.n_units, dtype=bool)
    assert rev.render(0, keep) == units.render(units.n_docs - 1, np.ones(units.n_units, dtype=bool))


def test_mean_log_odds():
    p = np.array([0.1, 0.5, 0.9, 0.99])
    np.testing.assert_allclose(mean_log_odds(p, p), p)
    np.testing.assert_allclose(mean_log_odds(p, 1 - p), 0.5)
    np.testing.assert_allclose(mean_log_odds(p, p[::-1]), mean_log_odds(p[::-1], p))
    assert np.isfinite(mean_log_odds(np.array([0.0, 1.0]), np.array([1.0, 1.0]))).all()  # clipped, never inf/nan


def test_passes_must_be_one_or_two():
    from rag_opt.compressors import SentinelCompressor

    with pytest.raises(InvalidInputError, match="passes must be 1 or 2"):
        SentinelCompressor(None, passes=3)  # type: ignore[arg-type]  # refused before the model is touched


@pytest.mark.model
def test_two_readings_are_the_merge_of_both_orders_and_do_not_depend_on_the_order(proxy):
    from rag_opt.compressors import SentinelCompressor

    units = _table(5)
    question = _example()["question"]
    one = SentinelCompressor(proxy)
    two = SentinelCompressor(proxy, passes=2)
    a = one.score(question, units)
    rev, rows = reversed_documents(units)
    b = one.score(question, rev)
    merged = two.score(question, units)
    np.testing.assert_allclose(merged.unit, mean_log_odds(a.unit, to_original(b.unit, rows)), atol=1e-4)
    np.testing.assert_allclose(merged.doc, mean_log_odds(a.doc, b.doc[::-1]), atol=1e-4)
    assert merged.calibrated == a.calibrated and merged.unit.shape == (units.n_units,)
    # reading the reversed context twice gives the same scores: the order no longer matters
    swapped = two.score(question, rev)
    np.testing.assert_allclose(to_original(swapped.unit, rows), merged.unit, atol=1e-4)
    np.testing.assert_allclose(swapped.doc[::-1], merged.doc, atol=1e-4)


def test_a_single_document_reads_the_same_in_both_orders():
    units = UnitTable.build([Document(text="One sentence. Another one.")], get_token_counter("gpt-4o").count)
    rev, rows = reversed_documents(units)
    assert rev.texts == units.texts and list(rows) == list(range(units.n_units))


def test_the_reversed_table_keeps_each_untitled_documents_link_names_and_other_names():
    """Untitled documents are linked by their subject and its other names: the reversed reading carries both with
    their documents."""
    docs = [
        Document(text="Sergey Olegovich Sirotkin is a racing driver. He drives for a team."),
        Document(text="The team signed Sergey Sirotkin in 2018."),
        Document(text="Dame Joan Alston Sutherland was a soprano."),
    ]
    units = UnitTable.build(docs, lambda s: len(s.split()))
    rev, _ = reversed_documents(units)
    assert rev.link_names == units.link_names[::-1]
    assert rev.link_variants == units.link_variants[::-1]
    assert rev.link_variants[-1] == ("Sergey Sirotkin",)
