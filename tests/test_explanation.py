"""Per-unit reasons: the select stage records why it kept or dropped every unit where it decides
(``Selection.reasons``), the result carries them on its units, ``explain_result(result)`` lists them bounded,
``explain: true`` on ``/v1/compress`` answers them and the ``rag-opt explain`` report shows them (one source).
Real HotpotQA dev questions and the real embedded proxy model."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from rag_opt.compressors.baselines import BM25Scorer
from rag_opt.compressors.selection import SelectionOptions, select
from rag_opt.compressors.unit_needs import unit_needs
from rag_opt.errors import InvalidInputError
from rag_opt.explanation import REASONS, describe, explain_result
from rag_opt.report import render_html
from rag_opt.text.tokens import get_token_counter
from rag_opt.text.units import UnitTable, join_spans
from rag_opt.types import MAX_EXPLAINED_UNITS, UNIT_REASONS, Document, OptimizeResult, to_documents
from tests.helpers import RECORDS_JSON, hotpot_dev, hotpot_docs

COUNT = get_token_counter("o200k_base").count
KEPT = {"selected", "fill", "required", "floor", "first", "best_of_document", "antecedent", "title", "heading"}
KEPT |= {"structure", "no_compression"}
DROPPED = {"budget", "recount", "below_threshold", "document_below_best", "unused"}


def test_every_reason_is_said_in_words_and_is_kept_or_dropped() -> None:
    assert set(REASONS) == set(UNIT_REASONS) == KEPT | DROPPED and not KEPT & DROPPED


def _checked(units: UnitTable, sel: Any, scores: np.ndarray, threshold: float | None = None) -> dict[str, int]:
    """Every row has a reason that agrees with the keep-mask, and what a kept row was kept with needs it."""
    needs = unit_needs(units)
    counts: dict[str, int] = {}
    assert len(sel.reasons) == units.n_units and sel.needed_by is not None and sel.rank is not None
    for r, reason in enumerate(sel.reasons):
        counts[reason] = counts.get(reason, 0) + 1
        assert (reason in KEPT) == bool(sel.keep[r]), (r, reason, units.texts[r])
        if reason in ("title", "heading", "structure"):
            assert not units.candidate[r]
        if reason in ("title", "heading", "structure", "antecedent"):
            by = int(sel.needed_by[r])
            assert sel.keep[by] and units.candidate[by] and r in needs[by], (r, reason, by)
        else:
            assert sel.needed_by[r] == -1
        if reason == "below_threshold":
            assert threshold is not None and scores[r] < threshold
        if reason == "unused":
            assert not units.candidate[r]
    ranked = sorted(np.flatnonzero(units.candidate), key=lambda i: (-scores[i], i))
    assert [int(sel.rank[i]) for i in ranked] == list(range(1, len(ranked) + 1))
    assert not sel.rank[~units.candidate].any()
    return counts


@pytest.mark.data
@pytest.mark.parametrize(
    ("budget", "options"),
    [
        ({"limit": 0.3}, SelectionOptions()),
        ({"limit": 0.15}, SelectionOptions(keep_best_per_doc=True)),
        ({"limit": 0.2}, SelectionOptions(keep_first=True)),
        ({"threshold": 0.5}, SelectionOptions()),
        ({"limit": 0.5}, SelectionOptions(drop_below_best=0.5, drop_keeps_bridges=False)),
    ],
)
def test_each_unit_has_the_reason_the_selector_decided_on_real_questions(
    budget: dict[str, float], options: SelectionOptions
) -> None:
    seen: dict[str, int] = {}
    for ex in hotpot_dev(6):
        units = UnitTable.build(to_documents(hotpot_docs(ex)), COUNT)
        scores = BM25Scorer().score(ex["question"], units).unit
        scores = scores / max(float(scores.max()), 1e-9)  # in [0, 1], as a probe's
        limit = int(budget["limit"] * units.tokens_before) if "limit" in budget else None
        threshold = budget.get("threshold")
        doc_scores = units.doc_best(scores) if options.drop_below_best is not None else None
        sel = select(units, scores, COUNT, limit=limit, threshold=threshold, options=options, doc_scores=doc_scores)
        for k, v in _checked(units, sel, scores, threshold).items():
            seen[k] = seen.get(k, 0) + v
    assert seen.get("title", 0) > 0 and seen.get("unused", 0) > 0  # each kept document's title; dropped ones'
    expected = (
        "below_threshold"
        if "threshold" in budget
        else "document_below_best"
        if options.drop_below_best
        else "best_of_document"
        if options.keep_best_per_doc
        else "first"
        if options.keep_first
        else "budget"
    )
    assert seen.get(expected, 0) > 0, seen


def test_the_antecedent_of_a_kept_back_reference_is_kept_for_it() -> None:
    text = (
        "The Louvre opened in 1793 in Paris. Tourists queue at its glass pyramid. "
        "Paris is the capital of France. It has many museums."
    )
    units = UnitTable.build([Document(text=text)], COUNT)
    rows = [r for r in range(units.n_units) if units.candidate[r]]
    scores = np.zeros(units.n_units)
    scores[rows[3]] = 0.9  # "It has many museums." is the best; its antecedent scores nothing
    sel = select(units, scores, COUNT, limit=int(units.tokens[rows[3]] + units.tokens[rows[2]]) + 1)
    _checked(units, sel, scores)
    assert sel.reasons[rows[3]] == "selected"
    assert sel.reasons[rows[2]] == "antecedent" and sel.needed_by[rows[2]] == rows[3]
    assert sel.reasons[rows[0]] == sel.reasons[rows[1]] == "budget"


def test_structure_headings_required_and_floor_reasons() -> None:
    docs = [
        Document(text=RECORDS_JSON),
        Document(text="# Prices\n\nItem 42 costs 56.00 dollars. Other items cost less.\n"),
        Document(text="Paris is the capital of France. It is large.", required=True),
    ]
    units = UnitTable.build(docs, COUNT)
    question = "How much does item 42 cost?"
    scores = BM25Scorer().score(question, units).unit
    sel = select(units, scores, COUNT, limit=120)
    counts = _checked(units, sel, scores)
    assert counts["structure"] >= 2 and counts["heading"] == 1 and counts["required"] == 1, counts
    # nothing fits: the required document's best unit is kept anyway, and the array's brackets are not needed
    sel = select(units, scores, COUNT, limit=1)
    counts = _checked(units, sel, scores)
    assert counts.get("required", 0) == 1 and sel.over_budget > 0
    assert sel.reasons[0] == "unused" and units.kind[0] == "json"
    alone = UnitTable.build(docs[1:2], COUNT)
    sel = select(alone, BM25Scorer().score(question, alone).unit, COUNT, limit=1)
    assert "floor" in sel.reasons and sel.over_budget > 0
    # no budget: everything, for that reason
    sel = select(units, scores, COUNT)
    assert set(sel.reasons) == {"no_compression"} and sel.keep.all()


# -- the library: the result's units, the bounded explanation and the report -------------------------------------
@pytest.fixture(scope="module")
def optimizer() -> Any:
    from rag_opt import ContextOptimizer

    return ContextOptimizer()


def _assert_kept_text_is_the_kept_units(result: OptimizeResult, docs: list[dict[str, Any]]) -> None:
    explanation = explain_result(result, max_units=None)
    assert not explanation.truncated and explanation.units_listed == explanation.units_total
    texts = {d.index: d.text for d in result.documents}
    for e in explanation.documents:
        assert e.units, e
        assert all(u.reason is not None and describe(u) for u in e.units)
        kept = [(u.start, u.end) for u in e.units if u.kept]
        joined = join_spans(docs[e.index]["text"], kept)
        # the kept units, joined; the space after the last one is not left trailing unless all are kept
        assert (joined if all(u.kept for u in e.units) else joined.rstrip()) == texts.get(e.index, ""), e.index
        assert e.kept == (e.index in texts)


@pytest.mark.model
@pytest.mark.data
def test_explain_gives_every_unit_a_reason_and_the_kept_units_are_the_kept_text(optimizer: Any) -> None:
    reasons: set[str] = set()
    for ex in hotpot_dev(5):
        docs = hotpot_docs(ex)
        result = optimizer.optimize(ex["question"], docs, ratio=1 / 3)
        _assert_kept_text_is_the_kept_units(result, docs)
        units = [u for d in [*result.documents, *result.dropped] for u in d.units]
        assert {u.scored_by for u in units} == {"probe"}
        ranks = sorted(u.rank for u in units if u.rank is not None)
        assert ranks == list(range(1, len(ranks) + 1))
        reasons |= {u.reason for u in units if u.reason is not None}
    assert {"selected", "budget"} <= reasons
    # the lexical tier: each decision is a lexical-tier one, and said so
    result = optimizer.optimize(ex["question"], docs, ratio=1 / 3, tier="lexical")
    _assert_kept_text_is_the_kept_units(result, docs)
    unit = result.documents[0].units[0]
    assert unit.scored_by == "lexical-probe" and "lexical-tier decision" in describe(unit)


@pytest.mark.model
def test_a_structured_row_under_the_model_tier_is_a_lexical_tier_decision(optimizer: Any) -> None:
    prose = "Item prices change every week. The shop is open daily."
    result = optimizer.optimize("How much does item 42 cost?", [RECORDS_JSON, prose], target_tokens=80)
    units = [u for d in [*result.documents, *result.dropped] for u in d.units]
    assert {u.scored_by for u in units if u.kind == "json" and u.rank is not None} == {"lexical-probe"}  # the rows
    assert any(describe(u).endswith("(a lexical-tier decision: scored by the lexical probe)") for u in units)
    assert {u.scored_by for u in units if u.kind == "sentence"} == {"probe"}


def test_the_explanation_is_bounded_and_counts_what_it_leaves_out() -> None:
    from rag_opt import ContextOptimizer

    ex = hotpot_dev(1)[0]
    docs = hotpot_docs(ex)
    result = ContextOptimizer(tier="lexical").optimize(ex["question"], docs, ratio=0.3)
    full = explain_result(result, max_units=None)
    assert explain_result(result).max_units == MAX_EXPLAINED_UNITS and full.units_total > 12
    short = explain_result(result, max_units=12)
    assert short.truncated and short.units_listed == 12 and short.units_total == full.units_total
    left, expected = 12, []
    for d in full.documents:  # input order, each document's units until the bound
        expected.append(min(d.units_total, left))
        left -= expected[-1]
    assert [len(d.units) for d in short.documents] == expected
    assert [d.units for d in short.documents][0] == full.documents[0].units[: expected[0]]
    assert sum(short.reasons.values()) == full.units_total and short.reasons == full.reasons
    with pytest.raises(InvalidInputError, match="max_units"):
        explain_result(result, max_units=-1)


@pytest.mark.data
def test_the_report_shows_each_units_reason_from_the_explanation() -> None:
    from rag_opt import ContextOptimizer

    ex = hotpot_dev(2)[1]
    docs = hotpot_docs(ex)
    result = ContextOptimizer(tier="lexical").optimize(ex["question"], docs, ratio=0.3)
    page = render_html(result, docs)
    tips = re.findall(r'<span class="u (?:keep|drop)"[^>]*title="([^"]*)"', page)
    units = [u for e in explain_result(result, max_units=None).documents for u in e.units]
    assert len(tips) == len(units)
    for reason, n in explain_result(result).reasons.items():
        assert f'<code>{reason}</code></td><td class="num">{n}</td>' in page
    assert sum(REASONS["budget"] in t for t in tips) == sum(u.reason == "budget" for u in units) > 0


# -- /v1/compress explain: true --------------------------------------------------------------------------------
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client(optimizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    from rag_opt.server.app import create_app
    from rag_opt.server.settings import ProxySettings

    settings = ProxySettings(upstream="http://127.0.0.1:9/v1", time_budget_ms=86_400_000.0, warmup=False)
    app = create_app(settings, optimizer=optimizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        yield c
    app.state.ragopt.pool.shutdown()


@pytest.mark.model
@pytest.mark.data
@pytest.mark.anyio
async def test_compress_explain_lists_every_units_reason_and_the_kept_units_are_the_answer(
    client: httpx.AsyncClient,
) -> None:
    ex = hotpot_dev(3)[2]
    docs = [{"text": d["text"], "title": d["title"], "id": d["id"]} for d in hotpot_docs(ex)]
    body = {"question": ex["question"], "documents": docs, "ratio": 1 / 3, "ordering": "relevance"}
    plain = (await client.post("/v1/compress", json=body)).json()
    assert plain["explanation"] is None
    r = await client.post("/v1/compress", json={**body, "explain": True})
    out = r.json()
    assert r.status_code == 200 and out["status"] == "optimized", r.text
    explanation = out["explanation"]
    assert [d["index"] for d in explanation["documents"]] == list(range(len(docs)))
    assert not explanation["truncated"] and explanation["max_units"] == MAX_EXPLAINED_UNITS
    answered = {d["index"]: d["text"] for d in out["documents"]}
    assert {docs[i]["id"] for i in set(range(len(docs))) - set(answered)} == set(out["dropped"])
    for e in explanation["documents"]:
        assert len(e["units"]) == e["units_total"] > 0
        assert all(u["reason"] in REASONS for u in e["units"])
        kept = [(u["start"], u["end"]) for u in e["units"] if u["kept"]]
        joined = join_spans(docs[e["index"]]["text"], kept)
        assert (joined if all(u["kept"] for u in e["units"]) else joined.rstrip()) == answered.get(e["index"], "")
        if e["position"] is not None:
            assert out["documents"][e["position"]]["index"] == e["index"]
    assert plain["documents"] == out["documents"]  # explaining changes nothing else
