"""Records named by a single character or a phrase: structured rows read every term and adjacent pairs of terms.

bm25s's default terms are words of two characters or more, so "How much does item 3 cost?" used to match no
record by its number, and the first record (a position prior learnt on prose) was kept instead; "item 26" tied
with the record priced 26.00.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag_opt.compressors.features import lexical_features
from rag_opt.compressors.lexical import RECORD_TERMS, TERMS, bm25_scores, term_overlap
from rag_opt.compressors.structured import structured_rows
from rag_opt.pipeline import ContextOptimizer
from rag_opt.text.units import UnitTable
from rag_opt.types import Document
from tests.helpers import RECORDS, RECORDS_CSV, RECORDS_JSON

AS_JSON, AS_CSV = RECORDS_JSON, RECORDS_CSV


def _kept_record(result, text: str, k: int, fmt: str) -> bool:
    price = f"{RECORDS[k - 1]['price']:.2f}" if fmt == "csv" else json.dumps(RECORDS[k - 1]["price"])
    row = f"{k},item {k}," if fmt == "csv" else f'"id": {k},'
    kept = [text[u.start : u.end] for d in result.documents for u in d.units if u.kept]
    return any(row in unit and price in unit for unit in kept)


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_the_lexical_tier_keeps_the_record_asked_for_by_any_number(fmt: str) -> None:
    text = AS_JSON if fmt == "json" else AS_CSV
    opt = ContextOptimizer(tier="lexical")
    missed = [
        k
        for k in range(1, len(RECORDS) + 1)
        if not _kept_record(opt.optimize(f"How much does item {k} cost?", [text], target_tokens=10), text, k, fmt)
    ]
    assert missed == []  # single digits (2-9) and item 26 (a tie with the price 26.00) were missed before


@pytest.mark.model
def test_the_model_tier_keeps_the_record_asked_for_by_a_single_digit() -> None:
    opt = ContextOptimizer()
    for k in (*range(1, 10), 26, 42):
        result = opt.optimize(f"What is the stock of item {k}?", [AS_JSON], target_tokens=10)
        assert _kept_record(result, AS_JSON, k, "json"), k


def test_record_terms_add_single_characters_and_adjacent_pairs_and_prose_terms_are_unchanged() -> None:
    texts = ["3,item 3,tools,7.25,21", "18,item 18,tools,26.00,26", "26,item 26,kitchen,36.00,32"]
    # "3" is no term of two characters: under TERMS the question matches as "item" alone would
    assert np.array_equal(bm25_scores("How much does item 3 cost?", texts), bm25_scores("item", texts))
    single = bm25_scores("How much does item 3 cost?", texts, pattern=RECORD_TERMS)
    assert single.argmax() == 0 and single[0] > 0
    pairs = bm25_scores("How much does item 26 cost?", texts, pattern=RECORD_TERMS)
    assert pairs[2] > pairs[1] > 0  # both hold "26" twice; only the third holds "item 26"
    assert term_overlap("item 3", texts, pattern=RECORD_TERMS)[0] == 1.0
    assert term_overlap("item 3", texts, pattern=TERMS)[0] == 1.0  # "item" is its only term
    prose = ["Apollo 8 was the first crewed spacecraft to orbit the Moon.", "Apollo 11 landed on it."]
    assert np.array_equal(bm25_scores("Apollo 8", prose), bm25_scores("Apollo 8", prose, pattern=TERMS))


def test_only_record_rows_read_record_terms_and_lose_their_position_prior() -> None:
    docs = [
        Document(id="p", text="Item 3 is a hammer. It costs a lot. The shop sells many tools."),
        Document(id="r", text=AS_CSV),
    ]
    units = UnitTable.build(docs, lambda s: max(1, len(s) // 4))
    rows = structured_rows(units)
    assert rows.any() and not rows[units.doc == 0].any()
    feats = lexical_features("How much does item 3 cost?", units, np.asarray(units.tokens))
    prose = np.flatnonzero((units.doc == 0) & units.candidate)
    assert feats[prose[0], 5] == 1.0 and feats[prose, 7].tolist() == [0.0, 0.5, 1.0]  # lead sentence, place
    assert (feats[rows, 5] == 0.0).all() and (feats[rows, 7] == 0.5).all()  # no record is "first"
    row3 = next(r for r in np.flatnonzero(rows) if units.texts[r].startswith("3,item 3,"))
    assert feats[row3, 0] == feats[rows, 0].max() == 1.0 or feats[row3, 0] == feats[:, 0].max()


def test_structured_rows_score_their_lexical_match_however_sure_the_probe_is_of_them() -> None:
    from rag_opt.compressors.structured import with_lexical_rows

    docs = [Document(id="p", text="The shop sells many tools. Item 3 is a hammer."), Document(id="r", text=AS_CSV)]
    units = UnitTable.build(docs, lambda s: max(1, len(s) // 4))
    rows = structured_rows(units)
    lexical = np.linspace(0.1, 0.2, units.n_units)
    sure = np.full(units.n_units, 0.99)  # a probe sure of every unit alike (a hidden layer on rows it never saw)
    out = with_lexical_rows(sure, units, lambda: lexical)
    np.testing.assert_array_equal(out[rows], lexical[rows])  # the rows' order is their lexical match's
    np.testing.assert_array_equal(out[~rows], sure[~rows])  # prose keeps the probe's scores
    called = []
    prose_only = UnitTable.build(docs[:1], lambda s: max(1, len(s) // 4))
    assert with_lexical_rows(sure[: prose_only.n_units], prose_only, lambda: called.append(1) or lexical) is not None
    assert not called  # no structured rows: the lexical scores are not computed
