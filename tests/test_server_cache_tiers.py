"""The encoding cache's store tiers behind ``rag-opt serve`` (``--cache-dir``, ``--cache-url``), its per-tier metrics
and its tenants (``--cache-namespace``, ``--expose-cache-hits``).

End to end with uvicorn, a recording upstream, the real embedded proxy model, real HotpotQA paragraphs and a real
``redis-server`` (skipped, saying why, without one): a second app sharing the Redis tier gets the first one's
documents as cache hits; a Redis that stops or a disk tier that cannot be written costs recomputation, never an
error; a tenant's documents are never another tenant's hits. The namespaces themselves and the micro-batches of two
tenants are checked without the model (the BM25 pipeline, workers held at a gate the test opens).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.datastructures import Headers

from rag_opt import ContextOptimizer
from rag_opt.compressors import BM25Scorer
from rag_opt.models.cache_store import TierStats
from rag_opt.models.encoding_cache import CacheStats, current_namespace
from rag_opt.server.settings import ProxySettings
from rag_opt.server.tenancy import ANONYMOUS, request_namespace
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, blocks
from tests.redis_server import RedisServer, require_redis
from tests.upstream_server import FakeUpstream, ServerThread, parse_metrics, serve_proxy

DOCS = EXAMPLE_DOCS[1:4]  # three short HotpotQA paragraphs (each request encodes them on this machine's CPU)
OTHER_DOCS = EXAMPLE_DOCS[4:7]
WAIT_S = 120.0  # a bound on every wait, never a speed budget
QUESTIONS = [
    "Which magazine was started first?",
    "Who founded the older magazine?",
    "When was the younger magazine started?",
    "Who publishes the magazine today?",
    "Where was the magazine published?",
]
TENANT_A = {"authorization": "Bearer tenant-a-secret-key"}
TENANT_B = {"authorization": "Bearer tenant-b-secret-key"}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


def chat(url: str, docs: list[dict[str, Any]], headers: dict[str, str] | None = None) -> httpx.Response:
    content = f"Answer from these documents only.\n\n{blocks(docs)}\n\nQuestion: {EXAMPLE_QUESTION}"
    body = {"model": "fake-llm", "messages": [{"role": "user", "content": content}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r


def compress(url: str, docs: list[dict[str, Any]], headers: dict[str, str] | None = None) -> dict[str, Any]:
    documents = [{"text": d["text"], "id": d["id"], "title": d["title"]} for d in docs]
    body = {"question": "Which magazine was started first?", "documents": documents}
    r = httpx.post(f"{url}/v1/compress", json=body, headers=headers, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def counters(r: httpx.Response) -> tuple[int, int]:
    """A response's x-ragopt-cache-hits / -misses (the test runs with --expose-cache-hits)."""
    return int(r.headers["x-ragopt-cache-hits"]), int(r.headers["x-ragopt-cache-misses"])


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=WAIT_S).text)


def tier(stats: CacheStats, name: str) -> TierStats:
    found = [t for t in stats.tiers if t.tier == name]
    assert len(found) == 1, stats.tiers
    return found[0]


def patient_shared_tier(state: Any, url: str) -> None:
    """Check that ``--cache-url`` gave the app's cache a Redis tier at ``url`` with the read timeout of
    ``--cache-timeout-ms`` (these tests set a long one: the default 50 ms is a production latency bound, and on this
    shared machine a slow read would mark the tier down for seconds and turn hits into misses, which these tests are
    not about; tests/test_models_cache_redis.py tests the timeouts)."""
    from rag_opt.models.cache_redis import RedisTier

    built = state.cache.shared_tier
    assert isinstance(built, RedisTier) and built.url == url and built.timeout == WAIT_S


@contextmanager
def serve(upstream_url: str, optimizer: Any = None, **settings: Any) -> Iterator[tuple[str, Any]]:
    """:func:`~tests.upstream_server.serve_proxy`, closing the app's cache tiers (their background writers) when
    the test leaves it."""
    with serve_proxy(upstream_url, optimizer, **settings) as (url, state):
        try:
            yield url, state
        finally:
            if state.cache is not None:
                state.cache.close()


# -- namespaces (no model) ----------------------------------------------------------------------------------------
def proxy_settings(**values: Any) -> ProxySettings:
    return ProxySettings(upstream="http://127.0.0.1:9/v1", **values)


def test_a_request_s_namespace_by_mode() -> None:
    none, by_key = proxy_settings(), proxy_settings(cache_namespace="api-key")
    by_header = proxy_settings(cache_namespace="header:X-Tenant")
    assert request_namespace(none, Headers({"authorization": "Bearer k1"})) is None  # one cache for all

    a = request_namespace(by_key, Headers({"authorization": "Bearer k1"}))
    assert a is not None and a != ANONYMOUS and "k1" not in a
    assert request_namespace(by_key, Headers({"authorization": "bearer  k1 "})) == a
    # one key is one tenant whichever header carries it (OpenAI's bearer token, Anthropic's, Azure's, Google's)
    for name in ("x-api-key", "api-key", "x-goog-api-key"):
        assert request_namespace(by_key, Headers({name: "k1"})) == a
    assert request_namespace(by_key, Headers({}), query=b"alt=sse&key=k1") == a  # Gemini's ?key=
    assert request_namespace(by_key, Headers({}), query=b"key=k%31") == a  # percent-encoded
    assert request_namespace(by_key, Headers({"authorization": "Bearer k2"})) not in (a, None)
    assert request_namespace(by_key, Headers({"authorization": "Basic azE6"})) not in (a, None)
    both = request_namespace(by_key, Headers({"authorization": "Bearer k1", "x-api-key": "k2"}))
    assert both not in (a, None, ANONYMOUS)  # a request presenting another key besides is another tenant
    for nothing in (Headers({}), Headers({"authorization": "Bearer "}), Headers({"x-tenant": "t1"})):
        assert request_namespace(by_key, nothing) == ANONYMOUS

    t1 = request_namespace(by_header, Headers({"X-Tenant": "t1"}))
    assert t1 is not None and t1 not in (ANONYMOUS, a) and "t1" not in t1
    assert request_namespace(by_header, Headers({"x-tenant": " t1 "})) == t1
    assert request_namespace(by_header, Headers({"x-tenant": "t2"})) not in (t1, None)
    assert request_namespace(by_header, Headers({"authorization": "Bearer k1"})) == ANONYMOUS
    assert request_namespace(by_header, Headers({"x-tenant": ""})) == ANONYMOUS


class NamespaceSpy(ContextOptimizer):
    """The BM25 pipeline recording, for every model-tier call, the encoding cache namespace in force in the worker
    thread and the questions; the first call waits at ``gate``."""

    def __init__(self) -> None:
        super().__init__(scorer=BM25Scorer())
        self.gate = threading.Event()
        self.calls: list[tuple[str, list[str]]] = []
        self._lock = threading.Lock()

    def optimize_batch(self, queries: Any, documents: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls.append((current_namespace(), list(queries)))
            first = len(self.calls) == 1
        if first:
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().optimize_batch(queries, documents, **kwargs)


class Background:
    def __init__(self, fn: Callable[[], httpx.Response]) -> None:
        self.out: list[httpx.Response] = []
        self.thread = threading.Thread(target=lambda: self.out.append(fn()), daemon=True)
        self.thread.start()

    def result(self) -> httpx.Response:
        self.thread.join(WAIT_S)
        assert self.out, "request did not finish"
        return self.out[0]


def wait_until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_tenants_are_never_batched_together_and_each_runs_in_its_namespace(
    upstream: tuple[FakeUpstream, str],
) -> None:
    spy = NamespaceSpy()
    settings = {"max_concurrency": 1, "max_queue": 8, "batch_wait_ms": 0, "max_batch": 8}
    with serve_proxy(upstream[1], spy, cache_namespace="header:x-tenant", **settings) as (url, state):

        def send(question: str, tenant: str) -> Background:
            content = f"{blocks(DOCS)}\n\n{question}"
            body = {"model": "fake-llm", "messages": [{"role": "user", "content": content}]}
            return Background(
                lambda: httpx.post(
                    f"{url}/v1/chat/completions", json=body, headers={"x-tenant": tenant}, timeout=WAIT_S
                )
            )

        first = send(QUESTIONS[0], "a")
        wait_until(lambda: len(spy.calls) == 1)  # the one worker is held at the gate
        queued = [send(QUESTIONS[i], tenant) for i, tenant in enumerate("abab", start=1)]
        wait_until(lambda: state.pool.gauges()[:2] == (4, 1))
        spy.gate.set()
        for bg in (first, *queued):
            assert bg.result().headers["x-ragopt-status"] == "optimized"
    ns_a = request_namespace(state.settings, Headers({"x-tenant": "a"}))
    ns_b = request_namespace(state.settings, Headers({"x-tenant": "b"}))
    assert spy.calls[0] == (ns_a, [QUESTIONS[0]])
    # the queued ones: one batch per tenant (same settings otherwise), each in its tenant's namespace
    batches = sorted((ns, sorted(questions)) for ns, questions in spy.calls[1:])
    assert batches == sorted([(ns_a, sorted(QUESTIONS[1:5:2])), (ns_b, sorted(QUESTIONS[2:5:2]))])


PROXY_KEY = "the-proxy-key-of-this-test-0123"


def test_the_namespace_is_the_client_s_key_as_the_routes_read_it(upstream: tuple[FakeUpstream, str]) -> None:
    """Through the real front door (a proxy ``--api-key``): the proxy key never names a tenant (it is removed
    before any route reads the request), the client's own key does, in a header or in Gemini's ``?key=``."""
    spy = NamespaceSpy()
    spy.gate.set()
    with serve_proxy(upstream[1], spy, api_key=PROXY_KEY, cache_namespace="api-key") as (url, state):
        text = f"{blocks(DOCS)}\n\n{QUESTIONS[0]}"
        chat_body = {"model": "fake-llm", "messages": [{"role": "user", "content": text}]}
        gemini_body = {"contents": [{"role": "user", "parts": [{"text": text}]}]}
        gemini = f"{url}/v1beta/models/fake-llm:generateContent"
        proxy_bearer = {"authorization": f"Bearer {PROXY_KEY}"}
        sent = [
            httpx.post(f"{url}/v1/chat/completions", json=chat_body, headers=proxy_bearer, timeout=WAIT_S),
            httpx.post(
                f"{url}/v1/chat/completions",
                json=chat_body,
                headers={**proxy_bearer, "x-api-key": "k1"},
                timeout=WAIT_S,
            ),
            httpx.post(
                gemini, params={"key": PROXY_KEY}, json=gemini_body, headers={"x-goog-api-key": "k1"}, timeout=WAIT_S
            ),
            httpx.post(gemini, params={"key": "k1"}, json=gemini_body, headers=proxy_bearer, timeout=WAIT_S),
            httpx.post(gemini, params={"key": "k2"}, json=gemini_body, headers=proxy_bearer, timeout=WAIT_S),
        ]
        for r in sent:
            assert r.status_code == 200 and r.headers["x-ragopt-status"] == "optimized", r.text
    key = request_namespace(state.settings, Headers({"authorization": "Bearer k1"}))
    other = request_namespace(state.settings, Headers({"x-api-key": "k2"}))
    assert key is not None and other not in (None, key)
    assert [ns for ns, _ in spy.calls] == [ANONYMOUS, key, key, key, other]
    assert PROXY_KEY not in repr(spy.calls) and "k1" not in key


# -- the store tiers, end to end ----------------------------------------------------------------------------------
@pytest.mark.model
def test_a_second_app_gets_hits_from_the_shared_tier_and_metrics_show_each_tier(
    upstream: tuple[FakeUpstream, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    common = {
        "encoding": "parallel",
        "encoding_cache_url": redis_server.url,
        "encoding_cache_timeout_ms": WAIT_S * 1e3,
        "encoding_cache_format": "int8",
        "encoding_cache_disk_bytes": 2**30,
        "expose_cache_hits": True,
    }
    # the first "rag-opt serve": reads the documents, writes them to its disk folder and to Redis
    with serve(upstream[1], None, encoding_cache_dir=str(tmp_path / "one"), **common) as (url, state):
        patient_shared_tier(state, redis_server.url)
        assert counters(chat(url, DOCS)) == (0, len(DOCS))
        assert state.cache.flush(WAIT_S)
        first = state.cache.stats()
        entries = first.entries  # each block's states and its sources' queries, and the prefix
        assert entries == 2 * len(DOCS) + 1
        assert tier(first, "shared").writes == tier(first, "disk").writes == entries
        assert redis_server.client().dbsize() == entries

    # a second one (another host: its own memory and disk folder), sharing only the Redis tier
    with serve(upstream[1], None, encoding_cache_dir=str(tmp_path / "two"), **common) as (url, state):
        patient_shared_tier(state, redis_server.url)
        r = chat(url, DOCS)
        assert r.headers["x-ragopt-status"] == "optimized" and counters(r) == (len(DOCS), 0)
        assert state.cache.flush(WAIT_S)  # the hits promoted into its disk tier
        stats = state.cache.stats()
        assert (stats.hits, stats.misses, stats.memory_hits, stats.shared_hits) == (entries, 0, 0, entries)
        shared, disk = tier(stats, "shared"), tier(stats, "disk")
        assert (shared.hits, shared.misses, shared.errors, shared.up) == (entries, 0, 0, True)
        assert (disk.hits, disk.misses, disk.writes, disk.errors) == (0, entries, entries, 0)
        assert shared.bytes_read == disk.bytes_written > 0

        m = metrics(url)
        assert m["ragopt_encoding_cache_hits_total"] == m["ragopt_encoding_cache_shared_hits_total"] == entries
        assert m["ragopt_encoding_cache_memory_hits_total"] == m["ragopt_encoding_cache_disk_hits_total"] == 0
        for label, t in (("shared", shared), ("disk", disk)):
            for field, family in (
                ("hits", "hits_total"),
                ("misses", "misses_total"),
                ("writes", "writes_total"),
                ("errors", "errors_total"),
                ("corrupt", "corrupt_total"),
                ("skipped", "skipped_total"),
                ("evictions", "evictions_total"),
                ("bytes_read", "read_bytes_total"),
                ("bytes_written", "written_bytes_total"),
                ("entries", "entries"),
                ("max_bytes", "max_bytes"),
            ):
                assert m[f'ragopt_encoding_cache_tier_{family}{{tier="{label}"}}'] == getattr(t, field), family
            assert m[f'ragopt_encoding_cache_tier_up{{tier="{label}"}}'] == 1
            assert m[f'ragopt_encoding_cache_tier_read_seconds_total{{tier="{label}"}}'] > 0
        assert m['ragopt_encoding_cache_tier_max_bytes{tier="disk"}'] == 2**30  # --cache-disk-bytes
        assert m['ragopt_encoding_cache_tier_bytes{tier="disk"}'] == disk.bytes > 0
        assert m['ragopt_encoding_cache_format_info{format="int8"}'] == 1

        status = httpx.get(f"{url}/stats", timeout=WAIT_S).json()["encoding_cache"]
        assert (status["format"], status["shared_hits"]) == ("int8", entries)
        assert status["tiers"]["shared"]["hits"] == entries and status["tiers"]["disk"]["writes"] == entries


@pytest.mark.model
def test_a_stopped_redis_costs_recomputation_never_an_error(
    upstream: tuple[FakeUpstream, str], redis_server: RedisServer
) -> None:
    with serve(
        upstream[1],
        None,
        encoding="parallel",
        encoding_cache_url=redis_server.url,
        encoding_cache_timeout_ms=WAIT_S * 1e3,
    ) as (url, state):
        patient_shared_tier(state, redis_server.url)
        r = chat(url, DOCS)
        assert r.headers["x-ragopt-status"] == "optimized"
        assert "x-ragopt-cache-hits" not in r.headers  # counters are off unless --expose-cache-hits
        assert state.cache.flush(WAIT_S)
        assert tier(state.cache.stats(), "shared").errors == 0

        redis_server.stop()
        r = chat(url, OTHER_DOCS)  # new documents: the model encodes them, the store is unreachable
        assert r.headers["x-ragopt-status"] == "optimized" and "x-ragopt-reason" not in r.headers
        assert int(r.headers["x-ragopt-tokens-after"]) < int(r.headers["x-ragopt-tokens-before"])
        assert state.cache.flush(WAIT_S)
        shared = tier(state.cache.stats(), "shared")
        assert shared.errors >= 1 and not shared.up
        m = metrics(url)
        assert m['ragopt_encoding_cache_tier_errors_total{tier="shared"}'] == shared.errors
        assert m['ragopt_encoding_cache_tier_up{tier="shared"}'] == 0
        assert m['ragopt_chat_requests_total{outcome="optimized"}'] == 2
        assert m.get('ragopt_fail_open_total{reason="error"}', 0) == 0


@pytest.mark.model
def test_a_disk_tier_that_cannot_be_written_costs_recomputation_never_an_error(
    upstream: tuple[FakeUpstream, str], tmp_path: Path
) -> None:
    folder = tmp_path / "cache"
    with serve(upstream[1], None, encoding="parallel", encoding_cache_dir=str(folder), expose_cache_hits=True) as (
        url,
        state,
    ):
        shutil.rmtree(folder)
        folder.write_text("a file where the cache folder was (an unmounted volume, a mistake)")
        first = chat(url, DOCS)
        assert first.headers["x-ragopt-status"] == "optimized" and counters(first) == (0, len(DOCS))
        again = chat(url, DOCS)  # the memory tier still answers
        assert again.headers["x-ragopt-status"] == "optimized" and counters(again) == (len(DOCS), 0)
        assert state.cache.flush(WAIT_S)
        disk = tier(state.cache.stats(), "disk")
        assert disk.errors >= 1 and (disk.writes, disk.hits, disk.bytes_written) == (0, 0, 0)
        m = metrics(url)
        assert m['ragopt_encoding_cache_tier_errors_total{tier="disk"}'] == disk.errors
        assert m['ragopt_chat_requests_total{outcome="optimized"}'] == 2
        assert folder.is_file()  # nothing was written in its place


@pytest.mark.model
def test_a_tenant_s_documents_are_never_another_tenant_s_hits(upstream: tuple[FakeUpstream, str]) -> None:
    with serve(upstream[1], None, encoding="parallel", cache_namespace="api-key", expose_cache_hits=True) as (
        url,
        state,
    ):
        assert counters(chat(url, DOCS, TENANT_A)) == (0, len(DOCS))
        before = state.cache.stats()

        r = chat(url, DOCS, TENANT_B)  # the same documents, another client key
        assert r.headers["x-ragopt-status"] == "optimized" and counters(r) == (0, len(DOCS))
        after_b = state.cache.stats()
        assert (after_b.hits, after_b.memory_hits) == (before.hits, before.memory_hits)
        assert after_b.entries == 2 * before.entries  # B's entries are B's own

        out = compress(url, DOCS, TENANT_A)  # tenant A again (through /v1/compress): its own entries
        assert out["status"] == "optimized" and (out["cache_hits"], out["cache_misses"]) == (len(DOCS), 0)
        again = compress(url, DOCS, {"x-api-key": "tenant-b-secret-key"})  # B's key in another header
        assert (again["cache_hits"], again["cache_misses"]) == (len(DOCS), 0)
        assert state.cache.stats().entries == after_b.entries


def test_metrics_show_the_tier_families_with_no_tier_and_no_cache(upstream: tuple[FakeUpstream, str]) -> None:
    """Without a cache (joint encoding, no model loaded: ``--no-warmup``) the families are there, with the whole
    cache's counters at 0 and no tier series."""
    with serve(upstream[1], None, encoding="joint") as (url, state):
        assert state.cache is None
        text = httpx.get(f"{url}/metrics", timeout=WAIT_S).text
    for family in (
        "ragopt_encoding_cache_tier_hits_total counter",
        "ragopt_encoding_cache_tier_errors_total counter",
        "ragopt_encoding_cache_tier_read_seconds_total counter",
        "ragopt_encoding_cache_tier_up gauge",
        "ragopt_encoding_cache_format_info gauge",
    ):
        assert f"# TYPE {family}" in text
    m = parse_metrics(text)
    assert m["ragopt_encoding_cache_shared_hits_total"] == m["ragopt_encoding_cache_memory_hits_total"] == 0
    assert not any(name.startswith("ragopt_encoding_cache_tier_") for name in m)
