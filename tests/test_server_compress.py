"""``POST /v1/compress`` (the compress-only sidecar), ``GET /v1/compress/schema``, ``GET /stats``, the
prometheus_client metrics and the per-request language, on the real app (httpx's ASGI transport) with the real
embedded proxy model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest

from rag_opt.server.app import create_app
from rag_opt.server.settings import ProxySettings
from rag_opt.text.units import join_spans
from rag_opt.wire.compress import compress_schema
from rag_opt.wire.errors import RequestError
from rag_opt.wire.request import parse_request
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, Recording
from tests.upstream_server import parse_metrics

pytestmark = pytest.mark.anyio
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "docs" / "compress.schema.json"
DOCS = EXAMPLE_DOCS[:4]
UNLIMITED_MS = 86_400_000.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def optimizer() -> Any:
    from rag_opt import ContextOptimizer

    return ContextOptimizer()


class Raising:
    def optimize(self, query: str, documents: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected optimizer failure")


@pytest.fixture
def make_client() -> Iterator[Any]:
    """A factory of httpx clients on a fresh app; the apps' worker pools are stopped afterwards."""
    apps: list[Any] = []

    def make(optimizer: Any, **settings: Any) -> httpx.AsyncClient:
        values = {"upstream": "http://127.0.0.1:9/v1", "time_budget_ms": UNLIMITED_MS, "warmup": False}
        app = create_app(ProxySettings(**{**values, **settings}), optimizer=optimizer)
        apps.append(app)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")

    yield make
    for app in apps:
        app.state.ragopt.pool.shutdown()


@pytest.fixture
async def client(make_client: Any, optimizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(optimizer) as c:
        yield c


def body(**extra: Any) -> dict[str, Any]:
    docs: list[Any] = [
        {"text": d["text"], "id": d["id"], "title": d["title"], "metadata": {"n": i}} for i, d in enumerate(DOCS)
    ]
    docs[-1] = DOCS[-1]["text"]  # a plain string too
    return {"question": EXAMPLE_QUESTION, "documents": docs, **extra}


# -- the sidecar ----------------------------------------------------------------------------------------------
@pytest.mark.model
async def test_compress_returns_verbatim_spans_within_the_budget(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/compress", json=body(budget={"target_tokens": 150}, ordering="relevance"))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "optimized" and out["tier"] == "model" and out["reason"] is None
    assert 0 < out["tokens_after"] <= 150 < out["tokens_before"]
    assert out["ordering"] == "relevance" and out["language"] == "en" and out["target_tokenizer"] == "o200k_base"
    assert out["timings"]["total_ms"] > 0 and out["timings"]["optimizer"]["score_ms"] > 0
    texts = [d["text"] for d in DOCS]
    assert len(out["documents"]) + len(out["dropped"]) == len(DOCS)
    scores = [d["score"] for d in out["documents"]]
    assert scores == sorted(scores, reverse=True)  # relevance ordering: best first
    for doc in out["documents"]:
        source = texts[doc["index"]]
        assert doc["kept_spans"] and doc["text"] == join_spans(source, [tuple(s) for s in doc["kept_spans"]])
        if doc["index"] < len(DOCS) - 1:
            assert doc["id"] == DOCS[doc["index"]]["id"] and doc["metadata"] == {"n": doc["index"]}
        else:
            assert doc["id"] == str(len(DOCS) - 1) and doc["metadata"] == {}


@pytest.mark.model
async def test_compress_lexical_tier_on_request_and_unchanged_without_compression(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/compress", json=body(budget={"ratio": 0.3}, tier="lexical"))
    out = r.json()
    assert r.status_code == 200 and out["status"] == "optimized_lexical" and out["tier"] == "lexical"
    assert out["tokens_after"] < out["tokens_before"]
    r = await client.post("/v1/compress", json=body(budget={"ratio": 1.0}, ordering="input"))
    out = r.json()
    assert out["status"] == "unchanged" and out["tokens_after"] == out["tokens_before"]
    assert [d["text"] for d in out["documents"]] == [d["text"] for d in DOCS]


@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        ({"documents": ["a b c."]}, "question", "missing"),
        ({"question": "q?", "documents": []}, "documents", "at least 1"),
        ({"question": " ", "documents": ["a."]}, "question", "blank"),
        ({"question": "q?", "documents": ["ok.", "  "]}, "documents", "documents[1] is empty"),
        ({"question": "q?", "documents": [{"txt": "a."}]}, "documents.0.text", "missing"),
        ({"question": "q?", "documents": ["a.", 5]}, "documents.1", "a string or an object"),
        ({"question": "q?", "documents": ["a."], "extra": 1}, "extra", "unknown field"),
        ({"question": "q?", "documents": ["a."], "budget": {"ratio": 0.5, "target_tokens": 9}}, "budget", "one"),
        ({"question": "q?", "documents": ["a."], "budget": {"ratio": 2}}, "budget.ratio", "less than or equal"),
        ({"question": "q?", "documents": ["a."], "ordering": "sideways"}, "ordering", "'lost_in_the_middle'"),
        ({"question": "q?", "documents": ["a."], "language": "english!"}, "language", "ISO 639"),
        ({"question": "q?", "documents": ["a."], "tier": "fast"}, "tier", "auto"),
        ({"question": "q?", "documents": ["a."], "tier": "lexical", "ordering": "calibrated"}, "tier", "proxy model"),
    ],
)
async def test_compress_bad_input_is_a_400_naming_the_problem(
    client: httpx.AsyncClient, payload: dict[str, Any], param: str, words: str
) -> None:
    r = await client.post("/v1/compress", json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"], err


async def test_compress_takes_the_python_api_spellings_as_aliases(client: httpx.AsyncClient) -> None:
    """One vocabulary: {"query", "ratio"} (the Python API's names) works as {"question", "budget": {"ratio"}}."""
    aliased = {"query": EXAMPLE_QUESTION, "documents": body()["documents"], "ratio": 0.3, "tier": "lexical"}
    r = await client.post("/v1/compress", json=aliased)
    assert r.status_code == 200, r.text
    r0 = await client.post("/v1/compress", json=body(budget={"ratio": 0.3}, tier="lexical"))
    assert [d["text"] for d in r.json()["documents"]] == [d["text"] for d in r0.json()["documents"]]
    assert r.json()["status"] == "optimized_lexical" and r.json()["tokens_after"] < r.json()["tokens_before"]
    for payload, words in [
        ({**aliased, "question": "q?"}, "as question or as query"),
        ({**aliased, "budget": {"ratio": 0.5}}, "as budget={...} or as ratio at the top level"),
        ({**aliased, "ratio": 0.2, "target_tokens": 9}, "one"),
    ]:
        r = await client.post("/v1/compress", json=payload)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


async def test_compress_invalid_json_and_other_methods(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/compress", content=b'{"question": ')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = await client.get("/v1/compress")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = await client.post("/v1/compress/schema")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


async def test_compress_fails_open_with_the_documents_as_sent(make_client: Any) -> None:
    async with make_client(Raising()) as c:
        r = await c.post("/v1/compress", json=body())
        out = r.json()
        assert r.status_code == 200 and out["status"] == "fail_open" and out["reason"] == "error"
        assert [d["text"] for d in out["documents"]] == [d["text"] for d in DOCS]
        assert all(d["kept_spans"] == [[0, len(d["text"])]] for d in out["documents"])
        assert out["tokens_before"] is None and out["tier"] == "none"
        m = parse_metrics((await c.get("/metrics")).text)
        assert m['ragopt_compress_requests_total{outcome="fail_open"}'] == 1
        assert m['ragopt_fail_open_total{reason="error"}'] == 1


async def test_compress_needs_the_proxy_key_and_respects_the_body_limit(make_client: Any) -> None:
    async with make_client(Raising(), api_key="k3y-compress-016", max_body_bytes=2000) as c:
        r = await c.post("/v1/compress", json={"question": "q?", "documents": ["a."]})
        assert r.status_code == 401
        r = await c.post(
            "/v1/compress",
            json={"question": "q?", "documents": ["a." * 2000]},
            headers={"x-ragopt-api-key": "k3y-compress-016"},
        )
        assert r.status_code == 413
        r = await c.get("/stats", headers={"authorization": "Bearer k3y-compress-016"})
        assert r.status_code == 200


# -- the schema -----------------------------------------------------------------------------------------------
def test_committed_schema_is_the_generated_one() -> None:
    committed = json.loads(SCHEMA_FILE.read_text())
    assert committed == compress_schema(), "regenerate it: python -m rag_opt.wire.compress > docs/compress.schema.json"
    assert set(committed["request"]["required"]) == {"question", "documents"}


async def test_schema_is_served(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/compress/schema")
    assert r.status_code == 200 and r.json() == compress_schema()


# -- metrics and /stats ---------------------------------------------------------------------------------------
@pytest.mark.model
async def test_metrics_and_stats_count_compress_requests(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/compress", json=body(budget={"ratio": 0.4}, target="gpt-4o"))
    out = r.json()
    assert out["status"] == "optimized"
    await client.post("/v1/compress", json={"question": "q?", "documents": []})
    metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_metrics(metrics.text)
    assert m['ragopt_requests_total{route="compress"}'] == 2
    assert m['ragopt_compress_requests_total{outcome="optimized"}'] == 1
    assert m['ragopt_compress_requests_total{outcome="rejected"}'] == 1
    assert m['ragopt_optimizations_total{tier="model"}'] == 1
    assert (
        m["ragopt_tokens_before_total"] == out["tokens_before"]
        and m["ragopt_tokens_after_total"] == out["tokens_after"]
    )
    assert m['ragopt_local_errors_total{kind="invalid_request"}'] == 1
    assert m["process_cpu_seconds_total"] > 0 and any(k.startswith("python_info{") for k in m)  # process collectors
    stats = (await client.get("/stats")).json()
    saved = out["tokens_before"] - out["tokens_after"]
    assert stats["tokens"] == {"before": out["tokens_before"], "after": out["tokens_after"], "saved": saved}
    assert stats["models"] == {
        "gpt-4o": {
            "optimizations": 1,
            "tokens_before": out["tokens_before"],
            "tokens_after": out["tokens_after"],
            "tokens_saved": saved,
        }
    }
    assert stats["requests"]["by_outcome"]["optimized"] == 1 and stats["requests"]["by_outcome"]["rejected"] == 1
    assert stats["requests"]["by_route"]["compress"] == 2 and stats["requests"]["total"] == 2


def test_metrics_keep_unknown_route_labels_and_histograms() -> None:
    from rag_opt.server.metrics import Metrics

    m = Metrics()
    m.request("messages")  # a route added later
    m.batch(3)
    m.add_in_flight(2)
    m.add_in_flight(-1)
    values = parse_metrics(m.render())
    assert values['ragopt_requests_total{route="messages"}'] == 1
    assert (
        values['ragopt_optimizer_batch_size_bucket{le="4.0"}'] == 1 and values["ragopt_optimizer_batch_size_count"] == 1
    )
    assert values["ragopt_optimizations_in_flight"] == 1
    assert values['ragopt_optimizer_state{state="cold"}'] == 1


# -- per-request language -------------------------------------------------------------------------------------
@pytest.mark.model
async def test_compress_language_reaches_segmentation_and_stopwords(make_client: Any, optimizer: Any) -> None:
    import rag_opt.compressors.lexical as lexical

    recording = Recording(optimizer)
    seen: list[str] = []
    real = lexical.stopwords

    def spy(language: str) -> tuple[str, ...]:
        seen.append(language)
        return real(language)

    async with make_client(recording) as c:
        with mock.patch.object(lexical, "stopwords", spy):
            lexical._memo.clear()  # remembered terms would skip the stopword lookup this spies on
            r = await c.post("/v1/compress", json=body(language="DE", tier="lexical"))
            assert r.status_code == 200 and r.json()["language"] == "de"
            assert recording.calls[-1]["language"] == "de" and set(seen) == {"de"}
            seen.clear()
            lexical._memo.clear()
            r = await c.post("/v1/compress", json=body(tier="lexical"))  # the optimizer's own language
            assert r.json()["language"] == "en" and "language" not in recording.calls[-1] and set(seen) == {"en"}


def test_chat_language_from_the_header_or_the_extension_field() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "q?"}]}).encode()
    _, options, _ = parse_request(raw, {"x-ragopt-language": "pt_BR"})
    assert options.language == "pt-br"
    raw = json.dumps({"messages": [{"role": "user", "content": "q?"}], "rag_opt": {"language": "de"}}).encode()
    _, options, _ = parse_request(raw, {"x-ragopt-language": "fr"})
    assert options.language == "de"  # the field over the header
    for headers, where in [({"x-ragopt-language": "klingon!"}, "x-ragopt-language"), ({}, "rag_opt.language")]:
        bad = {"messages": [{"role": "user", "content": "q?"}], **({} if headers else {"rag_opt": {"language": "1"}})}
        with pytest.raises(RequestError) as exc:
            parse_request(json.dumps(bad).encode(), headers)
        assert exc.value.param == where and exc.value.code == "invalid_language" and "ISO 639" in exc.value.message


def test_server_language_setting_is_checked_and_given_to_its_optimizer() -> None:
    settings = ProxySettings(upstream="http://x/v1", language="pt_BR", warmup=False)
    assert settings.language == "pt-br"
    app = create_app(settings)  # the optimizer is built, its model not loaded
    try:
        assert app.state.ragopt.optimizer.language == "pt-br"
    finally:
        app.state.ragopt.pool.shutdown()
    with pytest.raises(ValueError, match="ISO 639"):
        ProxySettings(upstream="http://x/v1", language="english please")


def test_optimize_takes_language_and_target_per_call() -> None:
    from rag_opt import ContextOptimizer
    from rag_opt.errors import InvalidInputError

    opt = ContextOptimizer()  # the lexical tier: no model is loaded
    docs = [d["text"] for d in DOCS]
    default = opt.optimize(EXAMPLE_QUESTION, docs, ratio=0.5, tier="lexical")
    other = opt.optimize(EXAMPLE_QUESTION, docs, ratio=0.5, tier="lexical", target="cl100k_base", language="de")
    assert default.target_tokenizer == "o200k_base" and other.target_tokenizer == "cl100k_base"
    assert other.tokens_before != default.tokens_before  # counted in the other tokenizer
    with pytest.raises(InvalidInputError, match="ISO 639"):
        opt.optimize(EXAMPLE_QUESTION, docs, ratio=0.5, tier="lexical", language="no such language")


def test_the_server_reads_titles_where_its_settings_say() -> None:
    """--title-keys and --no-title-from-text reach the optimizer; each document says which title was used."""
    from starlette.testclient import TestClient

    from rag_opt.server.app import create_app
    from rag_opt.server.settings import ProxySettings

    docs = [
        {"id": "a", "text": "Oak Island\nOak Island is an island in Nova Scotia. It is privately owned."},
        {"id": "b", "text": "Pasta needs boiling water. Salt it.", "metadata": {"headline": "Pasta", "title": "T"}},
    ]
    body = {
        "question": "Where is Oak Island?",
        "documents": docs,
        "ratio": 1.0,
        "ordering": "relevance",
        "tier": "lexical",
    }
    for options, expected in (
        ({}, {"a": ("Oak Island", "text"), "b": ("T", "metadata.title")}),
        (
            {"title_keys": "headline", "title_from_text": False},
            {"a": (None, None), "b": ("Pasta", "metadata.headline")},
        ),
    ):
        settings = ProxySettings(upstream="http://127.0.0.1:9/v1", warmup=False, **options)
        with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:
            answer = client.post("/v1/compress", json=body)
        assert answer.status_code == 200, answer.text
        got = {d["id"]: (d.get("title"), d.get("title_source")) for d in answer.json()["documents"]}
        assert got == expected


def test_the_server_drops_documents_far_below_the_best_when_its_settings_say() -> None:
    """--drop-below-best reaches the optimizer: under a budget the far weaker documents are dropped, and said."""
    from starlette.testclient import TestClient

    from rag_opt.server.app import create_app
    from rag_opt.server.settings import ProxySettings

    body = {"question": EXAMPLE_QUESTION, "documents": EXAMPLE_DOCS, "ratio": 0.5, "tier": "lexical"}
    kept = {}
    for share in (None, 0.5):
        settings = ProxySettings(upstream="http://127.0.0.1:9/v1", warmup=False, drop_below_best=share)
        with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:
            answer = client.post("/v1/compress", json=body)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        kept[share] = {d["id"] for d in data["documents"]}
        assert any("far below the best" in w for w in data["warnings"]) == (share is not None)
    assert kept[0.5] < kept[None]
    with pytest.raises(ValueError, match="drop_below_best"):
        ProxySettings(upstream="http://127.0.0.1:9/v1", drop_below_best=0)
