"""Direct tests of the select stage: a keep-mask under a budget, exact in target tokens, headers kept with text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag_opt.compressors.baselines import BM25Scorer
from rag_opt.compressors.selection import SelectionOptions, select
from rag_opt.text.tokens import get_token_counter
from rag_opt.text.units import UnitTable
from rag_opt.types import Document, to_documents
from tests.helpers import hotpot_dev, hotpot_docs

COUNT = get_token_counter("o200k_base").count


def _table(docs: list[Document]) -> UnitTable:
    return UnitTable.build(docs, COUNT)


def _real(n: int = 3) -> list[tuple[str, UnitTable, np.ndarray]]:
    out = []
    for ex in hotpot_dev(n):
        units = _table(to_documents(hotpot_docs(ex)))
        out.append((ex["question"], units, BM25Scorer().score(ex["question"], units).unit))
    return out


@pytest.mark.data
@pytest.mark.parametrize("ratio", [0.1, 0.2, 1 / 3, 0.5])
def test_the_rendered_kept_text_never_exceeds_the_budget_and_fills_it(ratio: float) -> None:
    for _, units, scores in _real():
        limit = int(ratio * units.tokens_before)
        sel = select(units, scores, COUNT, limit=limit)
        rendered = sum(
            (int(units.title_tokens[d]) if units.titles[d] else 0) + COUNT(units.render(d, sel.keep))
            for d in sel.kept_docs
        )
        assert rendered == int(sel.tokens_after.sum()) <= limit
        # greedy fill: no dropped candidate would still fit on its own (with its title) next to what is kept
        slack = limit - rendered
        dropped = [r for r in np.flatnonzero(units.candidate & ~sel.keep)]
        cheapest = min(
            int(units.tokens[r]) + (0 if sel.doc_kept[units.doc[r]] else int(units.title_tokens[units.doc[r]]))
            for r in dropped
        )
        assert cheapest > slack - 3  # within BPE merge noise of the budget


@pytest.mark.data
@pytest.mark.parametrize("ratio", [0.2, 1 / 3])
def test_the_fill_pass_leaves_no_unit_that_would_still_fit_once_rendered(ratio: float) -> None:
    # unit counts overestimate (a trailing space merges into the next word), so the rendered text ends under the
    # budget; every unit whose counted cost (with what it needs kept with it: title, heading, antecedent) fits the
    # slack (one token of allowance) must have been tried
    from rag_opt.compressors.unit_needs import unit_needs

    for _, units, scores in _real(6):
        limit = int(ratio * units.tokens_before)
        sel = select(units, scores, COUNT, limit=limit)
        total = int(sel.tokens_after.sum())
        assert total <= limit
        needs = unit_needs(units)
        for r in np.flatnonzero(units.candidate & ~sel.keep):
            d = int(units.doc[r])
            cost = int(units.tokens[r]) + sum(int(units.tokens[t]) for t in needs[r] if not sel.keep[t])
            if cost - 1 > limit - total:
                continue
            trial = sel.keep.copy()
            trial[r] = True
            trial[list(needs[r])] = True
            rendered = (int(units.title_tokens[d]) if units.titles[d] else 0) + COUNT(units.render(d, trial))
            assert total - int(sel.tokens_after[d]) + rendered > limit, (r, units.texts[r])


@pytest.mark.data
def test_the_best_scoring_units_are_kept_first() -> None:
    for _, units, scores in _real():
        sel = select(units, scores, COUNT, limit=int(units.tokens_before / 4))
        kept = scores[sel.keep & units.candidate]
        dropped = scores[~sel.keep & units.candidate]
        assert kept.size and dropped.size
        # everything kept scores at least as high as the median dropped unit
        assert kept.min() >= np.median(dropped) or kept.mean() > dropped.mean()


def test_titles_are_kept_exactly_with_their_documents_text() -> None:
    docs = to_documents(
        [
            {"title": "Alpha", "text": "Alpha is a letter. It comes first. Greek uses it."},
            {"title": "Beta", "text": "Beta is second. Nobody asked."},
        ]
    )
    units = _table(docs)
    scores = np.array([0.0, 0.9, 0.1, 0.2, 0.0, 0.05, 0.01])
    sel = select(units, scores, COUNT, limit=COUNT("Alpha\n") + COUNT("Alpha is a letter. "))
    assert sel.keep.tolist() == [True, True, False, False, False, False, False]
    # the kept text ends at its last word: the space after the unit is not left trailing
    assert sel.kept_docs == [0] and sel.texts == ("Alpha is a letter.", "")
    assert sel.tokens_after.tolist() == [COUNT("Alpha\n") + COUNT("Alpha is a letter."), 0]


def test_a_heading_is_kept_with_the_sentences_under_it_and_never_alone() -> None:
    text = "# Setup\nInstall it first. Then run it.\n# Usage\nCall optimize. It returns a result."
    units = _table(to_documents([text]))
    assert [units.kind[r] for r in range(units.n_units)].count("heading") == 2
    usage = units.kind.index("heading", 1)
    scores = np.array([0.0 if units.kind[r] == "heading" else 0.9 if r > usage else 0.1 for r in range(units.n_units)])
    sel = select(units, scores, COUNT, threshold=0.5)
    kept_kinds = [units.kind[r] for r in range(units.n_units) if sel.keep[r]]
    assert kept_kinds.count("heading") == 1 and sel.keep[usage]
    assert not sel.keep[0]  # the first heading has no kept sentence under it


def test_threshold_keeps_exactly_the_units_at_or_above_it() -> None:
    units = _table(to_documents(["One. Two. Three. Four."]))
    scores = np.array([0.2, 0.5, 0.7, 0.49])
    sel = select(units, scores, COUNT, threshold=0.5)
    assert sel.keep.tolist() == [False, True, True, False]


def test_keep_first_and_keep_best_per_doc_guarantee_one_unit_per_document_while_it_fits() -> None:
    docs = to_documents(["A one. A two. A three.", "B one. B two.", "C one. C two."])
    units = _table(docs)
    scores = np.array([0.1, 0.9, 0.8, 0.2, 0.3, 0.05, 0.01])
    limit = 12  # of 21 tokens: room for about three sentences
    plain = select(units, scores, COUNT, limit=limit)
    assert not plain.doc_kept[2]  # C scores lowest: left out
    best = select(units, scores, COUNT, limit=limit, options=SelectionOptions(keep_best_per_doc=True))
    assert best.doc_kept.all() and best.keep[5]  # C's best unit
    first = select(units, scores, COUNT, limit=limit, options=SelectionOptions(keep_first=True))
    assert first.keep[[0, 3, 5]].all()  # each document's first sentence


def test_no_budget_keeps_everything_and_a_budget_too_small_for_any_unit_keeps_the_best_one_and_says_so() -> None:
    units = _table(to_documents([{"title": "T", "text": "One. Two."}, "Three."]))
    scores = np.array([0.0, 0.5, 0.4, 0.3])
    everything = select(units, scores, COUNT)
    assert everything.keep.all() and everything.kept_docs == [0, 1]
    assert everything.texts == ("One. Two.", "Three.") and everything.over_budget == 0
    # nothing fits: the context is not emptied, its best unit (with its title) is kept whole, over the budget
    least = select(units, scores, COUNT, limit=0)
    assert least.keep.tolist() == [True, True, False, False] and least.kept_docs == [0]
    assert least.over_budget == int(least.tokens_after.sum()) > 0
    assert least.warnings and "over the budget" in least.warnings[0]
    # nothing reaches the threshold: the same, with no budget to be over
    low = select(units, scores, COUNT, threshold=0.9)
    assert low.kept_docs == [0] and low.keep[1] and low.over_budget == 0 and "threshold" in low.warnings[0]


def test_a_required_document_keeps_its_best_unit_and_the_others_fill_what_is_left() -> None:
    docs = to_documents(["Alpha one. Alpha two.", {"text": "Beta one. Beta two.", "required": True}])
    units = _table(docs)
    scores = np.array([0.9, 0.8, 0.1, 0.2])  # the required document scores lowest
    sel = select(units, scores, COUNT, limit=int(units.tokens[0] + units.tokens[3]))
    assert sel.keep.tolist() == [True, False, False, True] and sel.over_budget == 0  # its best (row 3) first
    tight = select(units, scores, COUNT, limit=1)  # nothing fits: the required unit still stays, over the budget
    assert tight.keep.tolist() == [False, False, False, True] and tight.over_budget == int(tight.tokens_after.sum()) - 1


def test_structured_rows_are_kept_with_their_brackets_and_header() -> None:
    records = [{"id": i, "name": f"item {i}", "price": i * 1.5} for i in range(40)]
    csv_text = "id,name,price\n" + "".join(f"{i},item {i},{i * 1.5}\n" for i in range(40))
    units = _table(to_documents([json.dumps(records, indent=2), csv_text]))
    rows = {d: [r for r in units.rows(d) if units.candidate[r]] for d in (0, 1)}
    assert len(rows[0]) == 40 and len(rows[1]) == 40  # one unit per record and per row
    scores = np.zeros(units.n_units)
    scores[rows[0][17]] = scores[rows[1][17]] = 1.0
    sel = select(units, scores, COUNT, limit=int(units.tokens[rows[0][17]] + units.tokens[rows[1][17]]) + 12)
    assert json.loads(sel.texts[0]) == [records[17]]
    assert sel.texts[1] == "id,name,price\n17,item 17,25.5"  # no newline left trailing after the kept row


def test_a_back_reference_is_kept_only_with_its_antecedent() -> None:
    """'It has many museums.' never dangles without 'Berlin is the capital of Germany.' (English), unless asked."""
    from rag_opt.compressors.selection import SelectionOptions, select
    from rag_opt.text.tokens import get_token_counter
    from rag_opt.text.units import UnitTable
    from rag_opt.types import to_documents

    count = get_token_counter().count
    docs = to_documents(["Berlin is the capital of Germany. It has many museums.", "Paris is in France."])
    units = UnitTable.build(docs, count)
    rows = {units.texts[r].strip(): r for r in range(units.n_units)}
    scores = np.zeros(units.n_units)
    scores[rows["It has many museums."]] = 5.0  # the best sentence opens with a back-reference
    scores[rows["Paris is in France."]] = 1.0
    room = int(units.tokens[rows["It has many museums."]]) + 1  # room for it alone, not with its antecedent
    on = select(units, scores, count, limit=room + int(units.tokens[rows["Paris is in France."]]))
    kept = {units.texts[r].strip() for r in np.flatnonzero(on.keep)}
    assert "It has many museums." not in kept or "Berlin is the capital of Germany." in kept
    off = select(units, scores, count, limit=room, options=SelectionOptions(keep_antecedents=False))
    assert "It has many museums." in {units.texts[r].strip() for r in np.flatnonzero(off.keep)}
    # with room for both, both are kept, in order
    both = select(units, scores, count, limit=int(units.tokens.sum()) - 1)
    kept = [units.texts[r].strip() for r in np.flatnonzero(both.keep)]
    assert kept.index("Berlin is the capital of Germany.") < kept.index("It has many museums.")
    # the rule is English's: German units get no antecedent needs
    from rag_opt.compressors.unit_needs import unit_needs

    german = to_documents(["Berlin ist die Hauptstadt. Es hat viele Museen. It ist ein Wort."])
    de = UnitTable.build(german, count, "de")
    assert all(len(n) == 0 for r, n in enumerate(unit_needs(de)) if de.kind[r] == "sentence")


def test_keep_best_per_doc_outranks_the_antecedent_rule() -> None:
    """Asked to keep every document, a document whose only unit that fits opens with a back-reference keeps it
    without its antecedent (the budget has no room for both)."""
    from rag_opt.compressors.selection import SelectionOptions, select
    from rag_opt.text.tokens import get_token_counter
    from rag_opt.text.units import UnitTable
    from rag_opt.types import to_documents

    count = get_token_counter().count
    long_first = "The mosque was built over seven years by hundreds of craftsmen from every corner of the empire."
    docs = to_documents(["Paris is the capital of France.", f"{long_first} It has six minarets."])
    units = UnitTable.build(docs, count)
    rows = {units.texts[r].strip(): r for r in range(units.n_units)}
    scores = np.zeros(units.n_units)
    scores[rows["Paris is the capital of France."]] = 2.0
    scores[rows["It has six minarets."]] = 1.0
    limit = int(units.tokens[rows["Paris is the capital of France."]] + units.tokens[rows["It has six minarets."]]) + 1
    plain = select(units, scores, count, limit=limit)
    assert not plain.keep[rows["It has six minarets."]]  # the rule: not without its antecedent, which does not fit
    every = select(units, scores, count, limit=limit, options=SelectionOptions(keep_best_per_doc=True))
    assert every.keep[rows["It has six minarets."]] and every.doc_kept.all()


def test_drop_below_best_takes_far_weaker_documents_out_of_the_competition_and_names_them() -> None:
    docs = to_documents(["A one. A two.", "B one. B two.", "C one. C two.", {"text": "D one.", "required": True}])
    units = _table(docs)
    # B's sentences outscore A's second one, but B as a document is far below A (0.05 < 0.2 x 0.9)
    scores = np.array([0.9, 0.3, 0.8, 0.7, 0.2, 0.1, 0.05])
    doc_scores = np.array([0.9, 0.05, 0.5, 0.01])
    limit = int(units.tokens_before) - 1
    plain = select(units, scores, COUNT, limit=limit, doc_scores=doc_scores)
    assert plain.doc_kept[1] and not plain.warnings  # without the option, B competes sentence by sentence
    gate = SelectionOptions(drop_below_best=0.2)
    sel = select(units, scores, COUNT, limit=limit, options=gate, doc_scores=doc_scores)
    # B is out; D is as weak but required: it stays; A and C are kept whole, since their text fits
    assert sel.kept_docs == [0, 2, 3] and sel.keep[[0, 1, 4, 5, 6]].all()
    assert sel.warnings == (
        "1 of 4 documents dropped as far below the best (relevance under 0.2 x the best's: documents 1)",
    )
    # without a budget nothing is dropped; the gate never drops the best document
    assert select(units, scores, COUNT, options=gate, doc_scores=doc_scores).keep.all()
    one = select(
        units, scores, COUNT, limit=limit, options=SelectionOptions(drop_below_best=1.0), doc_scores=doc_scores
    )
    assert 0 in one.kept_docs and 3 in one.kept_docs and not one.doc_kept[[1, 2]].any()


def test_drop_below_best_refuses_missing_or_negative_document_scores() -> None:
    units = _table(to_documents(["A one.", "B one."]))
    gate = SelectionOptions(drop_below_best=0.5)
    with pytest.raises(ValueError, match="needs document relevance"):
        select(units, np.array([0.5, 0.4]), COUNT, limit=3, options=gate)
    with pytest.raises(ValueError, match="non-negative"):
        select(units, np.array([0.5, 0.4]), COUNT, limit=3, options=gate, doc_scores=np.array([1.0, -2.0]))
    with pytest.raises(ValueError, match="2 finite numbers"):
        select(units, np.array([0.5, 0.4]), COUNT, limit=3, options=gate, doc_scores=np.array([1.0]))


def test_drop_below_best_keeps_a_document_that_a_kept_one_names_as_a_possible_second_hop() -> None:
    docs = to_documents(
        [
            {"title": "Ada Park", "text": "Ada Park plays for Riverton United. She joined in 2019."},
            {"title": "Riverton United", "text": "Riverton United is a club in Leeds. It was founded in 1901."},
            {"title": "Pasta", "text": "Pasta is boiled in salted water. It is served hot."},
        ]
    )
    units = _table(docs)
    scores = np.where(units.candidate, 0.1, 0.0)
    scores[units.doc == 0] = 0.9
    doc_scores = np.array([0.9, 0.01, 0.01])  # the club scores as low as the pasta: only the link tells them apart
    limit = int(units.tokens_before) - 1
    gate = SelectionOptions(drop_below_best=0.05)
    sel = select(units, scores, COUNT, limit=limit, options=gate, doc_scores=doc_scores)
    assert sel.kept_docs == [0, 1] and "documents 2)" in sel.warnings[0]
    bare = SelectionOptions(drop_below_best=0.05, drop_keeps_bridges=False)
    assert select(units, scores, COUNT, limit=limit, options=bare, doc_scores=doc_scores).kept_docs == [0]
