"""OpenTelemetry (``rag-opt serve --otel``, ``rag_opt.telemetry.enable()``): one ``rag_opt.optimize`` span per
optimization, a child of the request's W3C ``traceparent``, read back through the SDK's in-memory exporter; the
``traceparent`` reaches the upstream (tests/upstream_server.py) unchanged; the exporters come from ``OTEL_*``
(an OTLP/HTTP collector stood in for by a loopback server). The real embedded proxy model optimizes."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rag_opt import telemetry
from rag_opt.errors import ConfigurationError
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, blocks
from tests.upstream_server import FakeUpstream, ServerThread, request_body, serve_proxy

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

DOCS = EXAMPLE_DOCS[:3]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
REQUIRED = (
    "rag_opt.tokens_before",
    "rag_opt.tokens_after",
    "rag_opt.ratio",
    "rag_opt.status",
    "rag_opt.tier",
    "rag_opt.cache_hits",
    "rag_opt.cache_misses",
    "rag_opt.segment_ms",
    "rag_opt.load_ms",
    "rag_opt.score_ms",
    "rag_opt.select_ms",
    "rag_opt.order_ms",
    "rag_opt.total_ms",
)


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider (set here unless a test before set one) exporting to memory."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    assert isinstance(provider, TracerProvider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        fake.url = server.url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture(scope="module")
def proxy(upstream: FakeUpstream, spans: InMemorySpanExporter) -> Iterator[str]:
    from rag_opt import ContextOptimizer

    with serve_proxy(upstream.url, ContextOptimizer(), ordering="input", otel=True) as (url, _):  # type: ignore[attr-defined]
        yield url


def _ours(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == telemetry.SPAN_NAME]


def _assert_child_of_traceparent(span: ReadableSpan) -> None:
    assert span.parent is not None and span.parent.is_remote
    assert f"{span.context.trace_id:032x}" == TRACE_ID and f"{span.parent.span_id:016x}" == PARENT_ID


def _text() -> str:
    return f"Answer from these documents only.\n\n{blocks(DOCS)}\n\nQuestion: {EXAMPLE_QUESTION}"


ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "fake-llm", "messages": [{"role": "user", "content": _text()}]}),
    "responses": ("/v1/responses", {"model": "fake-llm", "input": _text()}),
    "anthropic": (
        "/v1/messages",
        {"model": "fake-llm", "max_tokens": 16, "messages": [{"role": "user", "content": _text()}]},
    ),
    "gemini": (
        "/v1beta/models/fake-llm:generateContent",
        {"contents": [{"role": "user", "parts": [{"text": _text()}]}]},
    ),
}


# -- the server: one span per request, a child of its traceparent, which goes upstream unchanged ---------------
@pytest.mark.model
@pytest.mark.parametrize("route", list(ROUTES))
def test_each_llm_route_records_one_span_under_the_traceparent_and_forwards_it(
    route: str, proxy: str, upstream: FakeUpstream, spans: InMemorySpanExporter
) -> None:
    path, body = ROUTES[route]
    spans.clear()
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1", "x-goog-api-key": "k"}
    r = httpx.post(proxy + path, json=body, headers=headers, timeout=None)
    assert r.status_code == 200, r.text
    assert r.headers["x-ragopt-status"] == "optimized"
    (span,) = _ours(spans)
    _assert_child_of_traceparent(span)
    attrs = dict(span.attributes or {})
    assert all(k in attrs for k in REQUIRED), sorted(set(REQUIRED) - set(attrs))
    assert attrs["rag_opt.status"] == "optimized" and attrs["rag_opt.tier"] == "model"
    assert attrs["rag_opt.tokens_before"] == int(r.headers["x-ragopt-tokens-before"])
    assert attrs["rag_opt.tokens_after"] == int(r.headers["x-ragopt-tokens-after"])
    assert 0 < attrs["rag_opt.ratio"] < 1 and attrs["rag_opt.score_ms"] > 0
    assert attrs["rag_opt.route"] == path and attrs["rag_opt.documents_before"] == len(DOCS)
    sent = upstream.last(path)
    assert sent.header("traceparent") == TRACEPARENT and sent.header("tracestate") == "vendor=1"


@pytest.mark.model
def test_a_request_with_nothing_to_optimize_is_a_span_with_its_status(proxy: str, spans: InMemorySpanExporter) -> None:
    spans.clear()
    body = {"model": "fake-llm", "messages": [{"role": "user", "content": "Hello there"}]}
    r = httpx.post(proxy + "/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}, timeout=None)
    assert r.status_code == 200 and r.headers["x-ragopt-status"] == "no_context"
    (span,) = _ours(spans)
    _assert_child_of_traceparent(span)
    attrs = dict(span.attributes or {})
    assert attrs["rag_opt.status"] == "no_context" and attrs["rag_opt.tier"] == "none"
    assert "rag_opt.tokens_before" not in attrs


@pytest.mark.model
def test_compress_records_its_span_with_the_answers_status(proxy: str, spans: InMemorySpanExporter) -> None:
    spans.clear()
    docs = [{"text": d["text"], "title": d["title"]} for d in DOCS]
    body = {"question": EXAMPLE_QUESTION, "documents": docs, "ratio": 0.4}
    r = httpx.post(proxy + "/v1/compress", json=body, headers={"traceparent": TRACEPARENT}, timeout=None)
    out = r.json()
    assert r.status_code == 200 and out["status"] == "optimized", r.text
    (span,) = _ours(spans)
    _assert_child_of_traceparent(span)
    attrs = dict(span.attributes or {})
    assert all(k in attrs for k in REQUIRED)
    assert (
        attrs["rag_opt.tokens_before"] == out["tokens_before"] and attrs["rag_opt.tokens_after"] == out["tokens_after"]
    )
    assert (
        attrs["rag_opt.route"] == "/v1/compress"
        and attrs["rag_opt.score_ms"] == out["timings"]["optimizer"]["score_ms"]
    )
    # the lexical tier on request: its status and tier
    spans.clear()
    r = httpx.post(proxy + "/v1/compress", json={**body, "tier": "lexical"}, timeout=None)
    assert r.json()["status"] == "optimized_lexical"
    (span,) = _ours(spans)
    assert span.parent is None  # no traceparent: a root span
    assert span.attributes is not None and span.attributes["rag_opt.tier"] == "lexical"
    assert span.attributes["rag_opt.status"] == "optimized_lexical"


@pytest.mark.model
def test_compress_messages_contract_records_its_span(proxy: str, spans: InMemorySpanExporter) -> None:
    spans.clear()
    body = {"model": "fake-llm", "messages": [{"role": "user", "content": _text()}]}
    r = httpx.post(proxy + "/v1/compress", json=body, headers={"traceparent": TRACEPARENT}, timeout=None)
    out = r.json()
    assert r.status_code == 200 and out["stats"]["status"] == "optimized", r.text
    (span,) = _ours(spans)
    _assert_child_of_traceparent(span)
    attrs = dict(span.attributes or {})
    assert all(k in attrs for k in REQUIRED), sorted(set(REQUIRED) - set(attrs))
    assert attrs["rag_opt.status"] == "optimized" and attrs["rag_opt.route"] == "/v1/compress"
    assert (
        attrs["rag_opt.tokens_before"] == out["tokens_before"] and attrs["rag_opt.tokens_after"] == out["tokens_after"]
    )
    # nothing to optimize: the messages come back as sent, and the span says why
    spans.clear()
    plain = {"messages": [{"role": "user", "content": "Hello there"}]}
    r = httpx.post(proxy + "/v1/compress", json=plain, headers={"traceparent": TRACEPARENT}, timeout=None)
    assert r.status_code == 200 and r.json()["stats"]["status"] == "no_context"
    (span,) = _ours(spans)
    assert span.attributes is not None and span.attributes["rag_opt.status"] == "no_context"


@pytest.mark.model
def test_without_otel_the_server_records_no_span_and_still_forwards_the_traceparent(
    upstream: FakeUpstream, spans: InMemorySpanExporter
) -> None:
    from rag_opt import ContextOptimizer

    spans.clear()
    with serve_proxy(upstream.url, ContextOptimizer(tier="lexical"), ordering="input") as (url, state):  # type: ignore[attr-defined]
        assert not state.tracing.on
        path, body = ROUTES["chat"]
        r = httpx.post(url + path, json=body, headers={"traceparent": TRACEPARENT}, timeout=None)
        assert r.headers["x-ragopt-status"] == "optimized_lexical"
    assert _ours(spans) == []
    assert upstream.last(path).header("traceparent") == TRACEPARENT  # forwarded all the same


# -- the library ----------------------------------------------------------------------------------------------
@pytest.mark.model
def test_the_library_records_a_span_per_optimization_under_the_current_span(spans: InMemorySpanExporter) -> None:
    from rag_opt import ContextOptimizer

    opt = ContextOptimizer(ordering="input")
    spans.clear()
    opt.optimize(EXAMPLE_QUESTION, DOCS, ratio=0.4)
    assert _ours(spans) == []  # off by default
    telemetry.enable()
    try:
        with trace.get_tracer("tests").start_as_current_span("app") as app:
            results = opt.optimize_batch([EXAMPLE_QUESTION, EXAMPLE_QUESTION], [DOCS, DOCS[:2]], ratio=0.4)
            with telemetry.untraced():  # the server's optimizations: it records its own span
                opt.optimize(EXAMPLE_QUESTION, DOCS, ratio=0.4)
    finally:
        telemetry.enable(False)
    ours = _ours(spans)
    assert len(ours) == 2
    for span, result in zip(ours, results, strict=True):
        assert span.parent is not None and span.parent.span_id == app.get_span_context().span_id
        attrs = dict(span.attributes or {})
        assert attrs["rag_opt.status"] == "optimized" and attrs["rag_opt.tier"] == "model"
        assert attrs["rag_opt.tokens_before"] == result.tokens_before
        assert attrs["rag_opt.tokens_after"] == result.tokens_after
        assert attrs["rag_opt.cache_misses"] == result.cache_misses and attrs["rag_opt.ratio"] == result.ratio


def test_span_attributes_of_several_contexts_are_summed() -> None:
    from rag_opt import ContextOptimizer

    opt = ContextOptimizer(tier="lexical", ordering="input")
    a = opt.optimize(EXAMPLE_QUESTION, DOCS, ratio=0.4)
    b = opt.optimize(EXAMPLE_QUESTION, DOCS[:1], ratio=1.0)
    attrs = telemetry.span_attributes("optimized", None, [a, b], route="/v1/compress")
    assert attrs["rag_opt.tokens_before"] == a.tokens_before + b.tokens_before
    assert attrs["rag_opt.tier"] == "mixed" and attrs["rag_opt.contexts"] == 2
    assert "rag_opt.reason" not in attrs  # None is left out (OpenTelemetry takes no None)


def test_otel_without_opentelemetry_is_a_configuration_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if it were not installed
    with pytest.raises(ConfigurationError, match=r"\[otel\]"):
        telemetry.SpanRecorder(True)
    telemetry.SpanRecorder(False).record({}, "optimized", None, None, 0.0)  # off: nothing imported, nothing done


# -- exporters from the OTEL_* variables -------------------------------------------------------------------------
class _Collector:
    """An OTLP/HTTP collector: records the bodies posted to /v1/traces."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, bytes]] = []
        self.got = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await request_body(scope, receive, send)
        if body is None:
            return
        self.posted.append((scope["path"], body))
        self.got.set()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-protobuf")]}
        )
        await send({"type": "http.response.body", "body": b""})


def test_the_otlp_exporter_follows_the_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    collector = _Collector()
    with ServerThread(collector) as server:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", server.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "rag-opt-under-test")
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        provider = telemetry._provider_from_environment()
        span = provider.get_tracer("tests").start_span(telemetry.SPAN_NAME, attributes={"rag_opt.status": "optimized"})
        span.end()
        assert provider.force_flush(10_000)
        provider.shutdown()
    assert collector.got.is_set()
    path, body = collector.posted[0]
    assert path == "/v1/traces"
    assert telemetry.SPAN_NAME.encode() in body and b"rag-opt-under-test" in body and b"rag_opt.status" in body


@pytest.mark.parametrize(
    ("variable", "value"), [("OTEL_TRACES_EXPORTER", "zipkin-ish"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")]
)
def test_an_unknown_exporter_or_protocol_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=variable):
        telemetry._provider_from_environment()


def test_the_console_exporter_prints_the_span(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    provider = telemetry._provider_from_environment()
    provider.get_tracer("tests").start_span(telemetry.SPAN_NAME, attributes={"rag_opt.ratio": 0.5}).end()
    provider.force_flush(10_000)
    provider.shutdown()
    printed = json.loads(capsys.readouterr().out)
    assert printed["name"] == telemetry.SPAN_NAME and printed["attributes"]["rag_opt.ratio"] == 0.5
