"""The unit table: one row per unit, built once; every flat/per-document mapping goes through it."""

from __future__ import annotations

import numpy as np

from rag_opt.text.segment import segment
from rag_opt.text.tokens import get_token_counter
from rag_opt.text.units import UnitTable, join_spans, merge_spans
from rag_opt.types import to_documents
from tests.helpers import hotpot_dev, hotpot_docs

COUNT = get_token_counter("o200k_base").count


def test_rows_follow_the_documents_with_the_title_row_first() -> None:
    docs = to_documents([{"title": "Paris", "text": "Paris is big. It is old."}, "No title here."])
    t = UnitTable.build(docs, COUNT)
    assert t.n_docs == 2 and t.n_units == 4
    assert t.doc.tolist() == [0, 0, 0, 1]
    assert t.kind == ("title", "sentence", "sentence", "sentence")
    assert t.candidate.tolist() == [False, True, True, True]
    assert t.texts[0] == "Paris\n" and t.start[0] == -1
    assert [docs[0].text[s:e] for s, e in zip(t.start[1:3], t.end[1:3], strict=True)] == list(t.texts[1:3])
    assert t.bounds.tolist() == [0, 3, 4] and list(t.rows(1)) == [3]
    assert t.by_document() == [["Paris\n", "Paris is big. ", "It is old."], ["No title here."]]
    assert t.tokens.tolist() == [COUNT(x) for x in t.texts]
    assert t.tokens_before == COUNT("Paris\n") + COUNT(docs[0].text) + COUNT(docs[1].text)


def test_real_documents_round_trip_through_the_table() -> None:
    ex = hotpot_dev(1)[0]
    docs = to_documents(hotpot_docs(ex))
    t = UnitTable.build(docs, COUNT)
    keep = np.ones(t.n_units, dtype=bool)
    for d, doc in enumerate(docs):
        assert t.render(d, keep) == join_spans(doc.text, [(s.start, s.end) for s in segment(doc.text)])
        assert "".join(t.by_document()[d][1:]) == doc.text  # segments partition the text
    assert t.document_texts()[0].startswith(f"{docs[0].title}\n")


def test_doc_best_and_split_map_rows_to_documents() -> None:
    t = UnitTable.titled([["A\n", "a1", "a2"], ["B\n", "b1"]])
    values = np.array([9.0, 0.2, 0.7, 9.0, 0.4])
    assert t.doc_best(values).tolist() == [0.7, 0.4]  # title rows are not candidates
    assert [v.tolist() for v in t.split(values)] == [[9.0, 0.2, 0.7], [9.0, 0.4]]


def test_rendering_keeps_words_apart_only_where_a_cut_glues_them() -> None:
    text = "Super Junior-K.R.Y. He is one of them. Another one."
    assert merge_spans([(0, 5), (5, 9), (12, 14)]) == [(0, 9), (12, 14)]
    assert join_spans(text, [(0, 15), (20, 38)]) == "Super Junior-K. He is one of them."


def test_a_table_over_given_spans_keeps_the_datasets_sentences() -> None:
    ex = hotpot_dev(1)[0]
    title, sentences = ex["context"][0]
    doc = to_documents([{"title": title, "text": "".join(sentences)}])
    bounds = np.cumsum([0] + [len(s) for s in sentences])
    t = UnitTable.from_spans(doc, [[(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]], COUNT)
    assert t.texts == (f"{title}\n", *sentences)
    assert (
        t.kind[0] == "title"
        and set(t.kind[1:]) == {"sentence"}
        and t.candidate.tolist() == [False] + [True] * len(sentences)
    )
    assert t.tokens_before == COUNT(f"{title}\n") + COUNT("".join(sentences))


def test_the_kept_text_does_not_end_in_the_whitespace_after_its_last_unit() -> None:
    """A sentence unit carries the whitespace after it: between two kept runs it stays (the separator, verbatim),
    at the end of the kept text it goes, and the spans still point into the original text."""
    text = "Honey is sweet. It is made by bees.\n\nHoney keeps well. Bees dance. "
    t = UnitTable.build(to_documents([text]), COUNT)
    rows = {t.texts[r].strip(): r for r in range(t.n_units)}
    keep = np.zeros(t.n_units, dtype=bool)
    keep[[rows["Honey is sweet."], rows["Honey keeps well."]]] = True
    spans = t.kept_spans(0, keep)
    assert spans == [(0, 16), (37, 54)] and text[37:54] == "Honey keeps well."
    assert t.render(0, keep) == "Honey is sweet. Honey keeps well." == join_spans(text, spans)
    keep[rows["It is made by bees."]] = True  # a run that ends at a paragraph break keeps it as its separator
    assert t.render(0, keep) == "Honey is sweet. It is made by bees.\n\nHoney keeps well."
    keep[:] = False
    keep[rows["It is made by bees."]] = True
    assert t.render(0, keep) == "It is made by bees."  # not "...bees.\n\n"
    keep[:] = True  # kept whole: verbatim, its own trailing space included
    assert t.kept_spans(0, keep) == [(0, len(text))] and t.render(0, keep) == text
