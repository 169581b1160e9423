"""Issue 21, the server's limits: what a request may make the proxy do, and where it runs.

- ``/v1/compress`` refuses more than ``--max-documents`` documents with a 413 before any document is validated, and
  reads the request and builds its answer off the event loop (defect 2);
- the question has a token limit of its own, and the proxy-token limit counts it once per forward pass (defect 5);
- the lexical tier has the model's limits, a time budget and a bounded queue (defect 7);
- writing a request back is linear in its documents and texts (defect 8);
- ``/stats`` model names are bounded in length and the body is built off the event loop (defect 9);
- language codes are bounded, and what is logged about them is short and capped (defect 10);
- ``/v1/compress`` reads gzip bodies (bounded once decoded) and its types strictly (the quirks).

Nothing depends on the machine's speed: workers wait at gates the tests open, budgets run out when a test says
so, and "off the event loop" is the thread a step ran on.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import httpx
import pytest

from rag_opt import ContextOptimizer
from rag_opt.compressors import BM25Scorer
from rag_opt.errors import InvalidInputError, WorkLimitExceeded
from rag_opt.server.app import create_app
from rag_opt.server.compress import Compressor
from rag_opt.server.engine import Engine
from rag_opt.server.metrics import MAX_MODEL_CHARS, Metrics
from rag_opt.server.settings import ProxySettings
from rag_opt.server.state import ProxyState
from rag_opt.text import language as language_module
from rag_opt.types import Budget
from rag_opt.wire import compress as compress_module
from rag_opt.wire.chat import plan_request
from rag_opt.wire.compress_protocol import CompressRequest
from rag_opt.wire.errors import RequestError
from rag_opt.wire.job import Job
from rag_opt.wire.offload import INLINE_BYTES
from rag_opt.wire.request import parse_request
from rag_opt.work import QUESTION_CHARS_PER_TOKEN, WorkLimits, check_question, scope
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION
from tests.upstream_server import parse_metrics

pytestmark = pytest.mark.anyio
UNLIMITED_MS = 86_400_000.0
WAIT_S = 60.0  # a bound on every wait, never a speed budget
DOCS = [d["text"] for d in EXAMPLE_DOCS[:4]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Gated(ContextOptimizer):
    """rag-opt's real pipeline with the BM25 scorer (no model); its lexical tier waits at ``gate`` while
    ``hold`` is set, and counts its calls."""

    def __init__(self) -> None:
        super().__init__(scorer=BM25Scorer())
        self.gate = threading.Event()
        self.hold = False
        self.entered = threading.Event()
        self.lexical_calls = 0

    def optimize_batch(self, queries: Any, documents: Any, **kwargs: Any) -> Any:
        if kwargs.get("tier") == "lexical":
            self.lexical_calls += 1
            if self.hold:
                self.entered.set()
                assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().optimize_batch(queries, documents, **kwargs)


@pytest.fixture
def make_client() -> Iterator[Any]:
    """A factory of httpx clients on fresh apps (in this event loop); their pools are stopped afterwards."""
    apps: list[Any] = []

    def make(optimizer: Any, **settings: Any) -> httpx.AsyncClient:
        values = {"upstream": "http://127.0.0.1:9/v1", "time_budget_ms": UNLIMITED_MS, "warmup": False}
        app = create_app(ProxySettings(**{**values, **settings}), optimizer=optimizer)
        apps.append(app)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")

    yield make
    for app in apps:
        app.state.ragopt.pool.shutdown()
        if app.state.ragopt._lexical_pool is not None:
            app.state.ragopt._lexical_pool.shutdown()


def compress_body(**extra: Any) -> dict[str, Any]:
    return {"question": EXAMPLE_QUESTION, "documents": DOCS, **extra}


# -- defect 2: /v1/compress with very many documents ------------------------------------------------------------
async def test_compress_past_the_document_limit_is_a_413_before_any_document_is_validated(make_client: Any) -> None:
    opt = Gated()
    validated: list[Any] = []
    real = CompressRequest.model_validate

    def spy(data: Any, **kwargs: Any) -> Any:
        validated.append(data)
        return real(data, **kwargs)

    async with make_client(opt, max_documents=3) as c:
        with mock.patch.object(CompressRequest, "model_validate", spy):
            r = await c.post("/v1/compress", json=compress_body(tier="lexical"))  # 4 documents, the limit is 3
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == "too_many_documents" and err["param"] == "documents" and "3" in err["message"]
            assert validated == [] and opt.lexical_calls == 0  # refused before building anything
            r = await c.post("/v1/compress", json=compress_body(documents=DOCS[:3], tier="lexical"))
            assert r.status_code == 200 and r.json()["status"] == "optimized_lexical" and len(validated) == 1
        m = parse_metrics((await c.get("/metrics")).text)
        assert m['ragopt_compress_requests_total{outcome="rejected"}'] == 1
        assert m['ragopt_local_errors_total{kind="too_large"}'] == 1


async def test_compress_with_many_tiny_documents_is_refused_under_the_default_limit(make_client: Any) -> None:
    async with make_client(Gated()) as c:
        r = await c.post("/v1/compress", json={"question": "q?", "documents": ["a."] * 5_000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_documents"
        assert len(r.content) < 1_000  # not the documents as sent


async def test_compress_reads_and_answers_a_large_request_off_the_event_loop(make_client: Any) -> None:
    """The document checks and the fail-open answer (the documents as sent) run on a worker thread."""
    loop_thread = threading.get_ident()
    seen: dict[str, int] = {}
    real_check, real_answer = compress_module.check_documents, Compressor._answer

    def check(documents: Any) -> Any:
        seen["check"] = threading.get_ident()
        return real_check(documents)

    def answer(self: Compressor, job: Any, attempt: Any, explain: bool = False) -> Any:
        seen["answer"] = threading.get_ident()
        return real_answer(self, job, attempt, explain)

    big = [f"Document {i}. " + "Some words here. " * 400 for i in range(20)]  # ~140 KB
    assert len(json.dumps(big)) > INLINE_BYTES
    async with make_client(Gated(), max_units=5) as c:  # over the unit limit: fail-open, the documents as sent
        with (
            mock.patch.object(compress_module, "check_documents", check),
            mock.patch.object(Compressor, "_answer", answer),
        ):
            r = await c.post("/v1/compress", json={"question": "q?", "documents": big, "tier": "lexical"})
        out = r.json()
        assert r.status_code == 200 and out["status"] == "fail_open" and out["reason"] == "limit"
        assert [d["text"] for d in out["documents"]] == big
    assert seen["check"] != loop_thread and seen["answer"] != loop_thread


# -- defect 5: a long question -----------------------------------------------------------------------------------
def test_the_question_has_a_token_limit_of_its_own() -> None:
    counted: list[str] = []

    def count(text: str) -> int:
        counted.append(text)
        return len(text.split())

    with scope(limits=WorkLimits(max_question_tokens=10)):
        check_question("five words are in here", count)
        with pytest.raises(WorkLimitExceeded, match="question has 12 tokens"):
            check_question("one two three four five six seven eight nine ten eleven twelve", count)
        counted.clear()
        with pytest.raises(WorkLimitExceeded, match="question has"):
            check_question("x" * (10 * QUESTION_CHARS_PER_TOKEN + 1), count)
        assert counted == []  # far over: refused without counting it
    check_question("word " * 100_000, count)  # outside a scope nothing is limited


def test_the_pipeline_stops_a_long_question_before_segmenting() -> None:
    opt = ContextOptimizer(scorer=BM25Scorer())
    question = "Which magazine was started first? " * 200  # 1,200 words
    with mock.patch("rag_opt.pipeline.UnitTable.build") as build, scope(limits=WorkLimits(max_question_tokens=64)):
        with pytest.raises(WorkLimitExceeded, match="question"):
            opt.optimize(question, DOCS, ratio=0.5)
        build.assert_not_called()


async def test_a_long_question_fails_open_on_both_tiers(make_client: Any) -> None:
    question = "Which magazine was started first, and by whom was it founded? " * 40
    async with make_client(Gated(), max_question_tokens=64) as c:
        for tier in ("model", "lexical"):
            r = await c.post("/v1/compress", json={"question": question, "documents": DOCS, "tier": tier})
            out = r.json()
            assert r.status_code == 200 and out["status"] == "fail_open" and out["reason"] == "limit", out
        r = await c.post("/v1/compress", json=compress_body(tier="lexical"))  # an ordinary question is optimized
        assert r.json()["status"] == "optimized_lexical"


@pytest.mark.model
@pytest.mark.parametrize("encoding", ["joint", "parallel"])
def test_the_proxy_token_limit_counts_the_question(encoding: str) -> None:
    """A short document under the proxy-token limit, a long question over it: refused before any forward pass
    (before, only the documents' tokens were counted and the question's passes ran)."""
    opt = ContextOptimizer(encoding=encoding, cache=None)
    question = "Which of the two magazines was started first, and who founded it in which city? " * 12
    document = "Arthur's Magazine was an American literary periodical first published in 1844."
    with scope(limits=WorkLimits(max_proxy_tokens=120)), pytest.raises(WorkLimitExceeded, match="proxy tokens"):
        opt.optimize(question, [document], ratio=0.5)
    with scope(limits=WorkLimits(max_proxy_tokens=120)):  # the same document with a short question fits
        assert opt.optimize("Which magazine was started first?", [document, document], ratio=0.5).tier == "model"


# -- defect 7: the lexical tier's limits, budget and queue --------------------------------------------------------
async def test_the_lexical_tier_has_a_bounded_queue(make_client: Any) -> None:
    opt = Gated()
    opt.hold = True
    with mock.patch("rag_opt.models.threads.available_cores", return_value=1):
        async with make_client(opt, max_lexical_queue=0) as c:
            first = asyncio.ensure_future(c.post("/v1/compress", json=compress_body(tier="lexical")))
            assert await asyncio.to_thread(opt.entered.wait, WAIT_S)
            r = await asyncio.wait_for(c.post("/v1/compress", json=compress_body(tier="lexical")), WAIT_S)
            out = r.json()  # answered while the only lexical worker is held: not queued without bound
            assert out["status"] == "fail_open" and out["reason"] == "overload" and opt.lexical_calls == 1
            opt.gate.set()
            assert (await first).json()["status"] == "optimized_lexical"
            m = parse_metrics((await c.get("/metrics")).text)
            assert m['ragopt_fail_open_total{reason="overload"}'] == 1
            assert m['ragopt_optimizer_shed_total{reason="queue_full"}'] == 1


async def test_an_overloaded_lexical_tier_answers_429_under_reject(make_client: Any) -> None:
    opt = Gated()
    opt.hold = True
    with mock.patch("rag_opt.models.threads.available_cores", return_value=1):
        async with make_client(opt, max_lexical_queue=0, on_overload="reject") as c:
            first = asyncio.ensure_future(c.post("/v1/compress", json=compress_body(tier="lexical")))
            assert await asyncio.to_thread(opt.entered.wait, WAIT_S)
            r = await asyncio.wait_for(c.post("/v1/compress", json=compress_body(tier="lexical")), WAIT_S)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            opt.gate.set()
            assert (await first).status_code == 200


async def test_the_lexical_tier_has_the_time_budget(make_client: Any) -> None:
    opt = Gated()
    opt.hold = True
    expired = asyncio.Event()

    async def sleep(seconds: float) -> None:  # the budget runs out when the test says so
        await expired.wait()

    async with make_client(opt) as c:
        state = c._transport.app.state.ragopt  # type: ignore[attr-defined]
        state.lexical_pool.sleep = sleep
        pending = asyncio.ensure_future(c.post("/v1/compress", json=compress_body(tier="lexical")))
        assert await asyncio.to_thread(opt.entered.wait, WAIT_S)
        expired.set()
        out = (await asyncio.wait_for(pending, WAIT_S)).json()
        assert out["status"] == "fail_open" and out["reason"] == "timeout"
        opt.gate.set()
        m = parse_metrics((await c.get("/metrics")).text)
        assert m['ragopt_optimizer_timeouts_total{stage="running"}'] == 1


async def test_the_lexical_tier_keeps_the_document_limit() -> None:
    opt = Gated()
    state = ProxyState(ProxySettings(upstream="http://127.0.0.1:9/v1", max_documents=2, warmup=False), opt)
    try:
        attempt = await Engine(state).run(
            Job("q?", [{"text": t} for t in DOCS], Budget(ratio=0.5), "input", tier="lexical")
        )
        assert attempt.result is None and attempt.reason == "limit" and opt.lexical_calls == 0
    finally:
        state.pool.shutdown()


# -- defect 8: writing back is linear ------------------------------------------------------------------------------
class Counted(int):
    """An index that counts the equality tests made with it."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        Counted.comparisons += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_writing_back_compares_each_document_a_bounded_number_of_times() -> None:
    n = 1_000
    # many texts (one block each): a document's text was looked for in every text
    msgs = [{"role": "system", "content": f"<document>Fact {i}. It holds.</document>"} for i in range(n)]
    raw = json.dumps({"model": "m", "messages": [*msgs, {"role": "user", "content": "Which fact?"}]}).encode()
    plan = plan_request(raw, {})
    for d in plan.documents:
        d.container = Counted(d.container)  # type: ignore[assignment]
    Counted.comparisons = 0
    assert plan.render(None) == raw
    assert Counted.comparisons <= 4 * n
    # one text with many blocks, reordered: each kept block was looked for among all the blocks of its text
    content = "\n".join(f'<document id="{i}">Fact {i}. It holds.</document>' for i in range(n)) + "\nWhich fact?"
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    plan = plan_request(raw, {})
    result = ContextOptimizer(scorer=BM25Scorer()).optimize(
        plan.query or "", plan.optimizer_documents(), ratio=0.9, ordering="relevance", tier="lexical"
    )
    for d in result.documents:
        d.index = Counted(d.index)
    Counted.comparisons = 0
    body = plan.render(result)
    assert json.loads(body)["messages"][0]["content"] != content
    assert Counted.comparisons <= 8 * n


# -- defect 9: /stats ----------------------------------------------------------------------------------------------
def test_stats_model_names_are_bounded_in_length() -> None:
    m = Metrics()
    for i in range(3):
        m.optimization(0.01, 100, 50, 4, 2, model=f"{i}" + "x" * 1_000_000)
    body = m.stats_json()
    assert len(body) < 20_000  # (3 MB before)
    names = list(json.loads(body)["models"])
    assert len(names) == 3 and all(len(name) <= MAX_MODEL_CHARS + 3 for name in names)


async def test_stats_are_built_off_the_event_loop(make_client: Any) -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []
    real = Metrics.stats

    def stats(self: Metrics) -> dict[str, Any]:
        seen.append(threading.get_ident())
        return real(self)

    async with make_client(Gated()) as c:
        with mock.patch.object(Metrics, "stats", stats):
            r = await c.get("/stats")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json()["requests"]["total"] == 0 and seen and loop_thread not in seen


# -- defect 10: language codes -------------------------------------------------------------------------------------
def test_a_huge_language_code_is_refused_with_a_short_message() -> None:
    code = "en" + "-abcdefgh" * 110_000  # ~1 MB, well-formed subtags
    with pytest.raises(InvalidInputError, match="language must be") as exc:
        language_module.check_language(code)
    assert len(str(exc.value)) < 400
    raw = json.dumps({"messages": [{"role": "user", "content": "q?"}]}).encode()
    with pytest.raises(RequestError) as req_exc:
        parse_request(raw, {"x-ragopt-language": code})
    assert req_exc.value.code == "invalid_language" and len(req_exc.value.message) < 500


async def test_compress_refuses_a_huge_language_code_with_a_short_answer(make_client: Any) -> None:
    async with make_client(Gated()) as c:
        r = await c.post("/v1/compress", json=compress_body(language="en" + "-abcdefgh" * 110_000))
        assert r.status_code == 400 and r.json()["error"]["param"] == "language" and len(r.content) < 1_000


def test_languages_without_stopwords_are_logged_briefly_and_at_most_a_few_times(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(language_module, "_logged", set())
    language_module._stopwords.cache_clear()
    codes = [f"q{a}{b}-x-private" for a in "abcdefgh" for b in "abcdefgh"]  # 64 base codes, no stopword list
    with caplog.at_level(logging.INFO, logger="rag_opt.text.language"):
        for code in codes * 2:
            assert language_module.stopwords(code) == ()
    records = [r for r in caplog.records if r.name == "rag_opt.text.language"]
    assert len(records) == language_module.MAX_LOGGED_LANGUAGES + 1
    assert "not logged any more" in records[-1].getMessage()
    assert all(len(r.getMessage()) < 300 for r in records)
    language_module._stopwords.cache_clear()


# -- the /v1/compress quirks ---------------------------------------------------------------------------------------
async def test_compress_decodes_gzip_bodies_within_the_body_limit(make_client: Any) -> None:
    async with make_client(Gated(), max_body_bytes=200_000) as c:
        raw = gzip.compress(json.dumps(compress_body(tier="lexical")).encode())
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        r = await c.post("/v1/compress", content=raw, headers=headers)
        assert r.status_code == 200 and r.json()["status"] == "optimized_lexical", r.text
        bomb = gzip.compress(json.dumps({"question": "q?", "documents": ["a" * 5_000_000]}).encode())
        assert len(bomb) < 200_000
        r = await c.post("/v1/compress", content=bomb, headers=headers)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await c.post("/v1/compress", content=b"not gzip", headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding"


@pytest.mark.parametrize(
    ("budget", "param"),
    [
        ({}, "budget"),
        ({"target_tokens": True}, "budget.target_tokens"),
        ({"target_tokens": 100.0}, "budget.target_tokens"),
        ({"ratio": "0.5"}, "budget.ratio"),
        ({"threshold": "0.5"}, "budget.threshold"),
    ],
)
async def test_compress_reads_the_budget_strictly(make_client: Any, budget: dict[str, Any], param: str) -> None:
    async with make_client(Gated()) as c:
        r = await c.post("/v1/compress", json=compress_body(budget=budget, tier="lexical"))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


async def test_compress_strict_types_still_take_json_numbers(make_client: Any) -> None:
    async with make_client(Gated()) as c:
        for budget in ({"ratio": 1}, {"target_tokens": 80}, {"ratio": 0.4}):
            r = await c.post("/v1/compress", json=compress_body(budget=budget, tier="lexical"))
            assert r.status_code == 200, r.text
        r = await c.post("/v1/compress", json=compress_body(tier=True))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tier"
        r = await c.post("/v1/compress", content=b"[1, 2]", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
