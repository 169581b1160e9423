"""The proxy on Ray Serve (:mod:`rag_opt.server.ray_serve`): the routing key, the replica ranking and the ASGI
driver on their own (no Ray), then end to end: two replicas of the real proxy (parallel encoding, the embedded
model) on a local Ray with two CPUs, sharing one real redis-server, behind the routing ingress.

End to end, with document routing: requests over the same HotpotQA documents always reach the replica the ranking
predicts, two document sets predicted on different replicas are served by both, a chat request over the same
documents (as ``<document>`` blocks) streams back from the same replica, and a document set first read by one
replica is a shared-tier (Redis) hit when the other reads it (reached through ``x-ragopt-routing-key``). The
Ray tests skip without Ray Serve (``pip install -e '.[ray]'``), redis-server, or the HotpotQA data.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rag_opt.server.ray_serve.asgi import ForwardedRequest, Lifespan, serve_request
from rag_opt.server.ray_serve.keys import document_texts, rank_replicas, routing_key
from rag_opt.server.settings import ProxySettings
from tests.helpers import blocks, hotpot_dev, hotpot_docs
from tests.redis_server import RedisServer, free_port, require_redis
from tests.upstream_server import FakeUpstream, ServerThread

UPSTREAM = "http://127.0.0.1:9/v1"
DOCS = [{"id": "a", "text": "Paris is the capital of France."}, {"id": "b", "text": " The Seine flows in Paris. "}]


def body(question: str, docs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"question": question, "documents": docs, **extra}).encode()


# -- the routing key (no Ray) -----------------------------------------------------------------------------------
def test_the_key_is_the_documents_whatever_the_question_order_or_api() -> None:
    key = routing_key(body("Where?", DOCS))
    assert key is not None and len(key) == 32
    assert routing_key(body("Which river?", DOCS[::-1], ratio=0.33)) == key  # another question, another order
    assert routing_key(body("Where?", [d["text"].strip() for d in DOCS])) == key  # strings, stripped
    chat = {"messages": [{"role": "user", "content": f"{blocks([{**d, 'title': 'T'} for d in DOCS])}\n\nWhere?"}]}
    assert routing_key(json.dumps(chat).encode()) == key  # the same documents as <document> blocks of a chat
    part = {"type": "text", "text": blocks([{**DOCS[0], "title": ""}])}  # one in a content part, one in the extension
    mixed = {"messages": [{"role": "user", "content": [part]}], "rag_opt": {"documents": [DOCS[1]]}}
    assert routing_key(json.dumps(mixed).encode()) == key


def test_the_key_is_a_min_hash_and_none_without_documents() -> None:
    many = [{"id": str(i), "text": f"Document number {i} says something else."} for i in range(20)]
    key = routing_key(body("q", many))
    singles = {d["id"]: routing_key(body("q", [d])) for d in many}
    assert key == min(v for v in singles.values() if v is not None)  # the least of the documents' hashes
    owner = next(d for d in many if singles[d["id"]] == key)
    assert routing_key(body("q", [many[5], owner, many[7]])) == key  # so any subset holding that document keeps it
    assert routing_key(b'{"question": "q", "documents": []}') is None
    assert routing_key(b'{"messages": [{"role": "user", "content": "hi"}]}') is None
    assert routing_key(b"not json") is None and routing_key(b"\xff\xfe") is None
    assert routing_key(gzip.compress(body("q", DOCS)), content_encoding="gzip") is None
    assert routing_key(body("q", DOCS), content_encoding="identity") == routing_key(body("q", DOCS))
    tool = {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "a long tool result"}]}
    assert document_texts(tool) == ["a long tool result"]  # no blocks or documents: the tool results
    assert document_texts({"messages": [{"role": "user", "content": "<doc>x</doc>"}]}, tag="doc") == ["x"]


def test_replicas_are_ranked_by_rendezvous_hashing() -> None:
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"key-{i}" for i in range(400)]
    owner = {k: rank_replicas(k, replicas)[0] for k in keys}
    assert all(rank_replicas(k, replicas[::-1])[0] == owner[k] for k in keys)  # a function of the set
    shares = {r: sum(o == r for o in owner.values()) for r in replicas}
    assert all(60 <= n <= 140 for n in shares.values()), shares  # ~100 each
    fewer = replicas[:3]  # r3 goes: only its keys move
    assert all(rank_replicas(k, fewer)[0] == owner[k] for k in keys if owner[k] != "r3")
    # and a key's fallback is where it goes
    assert all(rank_replicas(k, fewer)[0] == rank_replicas(k, replicas)[1] for k in keys if owner[k] == "r3")


# -- the replica's ASGI driver (no Ray) -------------------------------------------------------------------------
def test_the_asgi_driver_runs_the_proxy_app_and_its_lifespan() -> None:
    from rag_opt.server.app import create_app

    settings = ProxySettings.from_sources({"upstream": UPSTREAM, "warmup": False}, {})

    async def run() -> list[list[dict[str, Any]]]:
        app = create_app(settings)
        lifespan = Lifespan(app)
        await lifespan.startup()
        assert lifespan.running
        request = ForwardedRequest(
            method="GET",
            path="/livez",
            headers=((b"host", b"127.0.0.1:8000"),),
            client=("127.0.0.1", 5000),
            server=("127.0.0.1", 8000),
        )
        out = [b async for b in serve_request(app, request, state=lifespan.state, extra_headers=((b"x-r", b"1"),))]
        missing = ForwardedRequest(method="GET", path="/nope", headers=((b"host", b"127.0.0.1:8000"),))
        out += [b async for b in serve_request(app, missing)]
        await lifespan.shutdown()
        assert not lifespan.running
        return out

    batches = asyncio.run(run())
    messages = [m for b in batches for m in b]
    starts = [m for m in messages if m["type"] == "http.response.start"]
    assert [s["status"] for s in starts] == [200, 404]
    assert (b"x-r", b"1") in [tuple(h) for h in starts[0]["headers"]]
    bodies = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    assert b'"status":"ok"' in bodies.replace(b" ", b"")


def test_a_forwarded_request_keeps_what_the_app_reads() -> None:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/compress",
        "raw_path": b"/v1/compress",
        "query_string": b"a=1",
        "headers": [(b"host", b"h"), (b"x-ragopt-routing-key", b"k"), (b"content-type", b"application/json")],
        "client": ("10.0.0.1", 4000),
        "server": ("127.0.0.1", 8000),
        "scheme": "http",
    }
    forwarded = ForwardedRequest.from_scope(scope, b"{}", drop_headers=(b"x-ragopt-routing-key",))
    rebuilt = forwarded.scope({"k": 1})
    assert rebuilt["headers"] == [(b"host", b"h"), (b"content-type", b"application/json")]
    assert (rebuilt["path"], rebuilt["query_string"], rebuilt["client"], rebuilt["state"]) == (
        "/v1/compress",
        b"a=1",
        ("10.0.0.1", 4000),
        {"k": 1},
    )


# -- end to end on Ray Serve ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_serve() -> None:
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]'): no Ray tests")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_redis()
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


@pytest.fixture(scope="module")
def ray_app(ray_serve: None, redis_server: RedisServer, upstream: tuple[FakeUpstream, str]) -> Iterator[str]:
    """Two replicas (parallel encoding, the embedded model) sharing ``redis_server``, with document routing, on a
    local Ray of two CPUs; the base URL. Everything is shut down at the end."""
    import ray
    from ray import serve

    from rag_opt.server.ray_serve.deployments import build_app, deploy

    settings = ProxySettings.from_sources(
        {
            "upstream": f"{upstream[1]}/v1",
            "encoding": "parallel",
            "encoding_cache_url": redis_server.url,
            "encoding_cache_timeout_ms": 30_000,  # a loaded machine's slow read is not what this test is about
            "expose_cache_hits": True,
            "port": free_port(),
            "max_body_bytes": 256 * 1024,
        },
        {},
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        url = deploy(build_app(settings, replicas=2, routing="documents"), settings, name="rag-opt-test")
        deadline = time.monotonic() + 60
        while True:  # Serve's HTTP proxy learns the route shortly after the application is running
            try:
                if httpx.get(f"{url}/livez", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the application did not answer /livez"
            time.sleep(0.2)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def stats(client: httpx.Client, url: str, key: str) -> tuple[str, dict[str, Any]]:
    """(the replica that answered, its /stats) for the routing key ``key``."""
    r = client.get(f"{url}/stats", headers={"x-ragopt-routing-key": key})
    assert r.status_code == 200, r.text
    return r.headers["x-ragopt-replica"], r.json()


def key_for(replica: str, replicas: list[str]) -> str:
    """A routing key that ``replica`` serves."""
    return next(k for k in (f"probe-{i}" for i in range(1000)) if rank_replicas(k, replicas)[0] == replica)


@pytest.mark.model
@pytest.mark.data
@pytest.mark.slow
def test_document_routing_keeps_documents_on_their_replica_and_shares_the_redis_tier(
    ray_app: str, redis_server: RedisServer, upstream: tuple[FakeUpstream, str]
) -> None:
    url = ray_app
    examples = hotpot_dev(12)
    with httpx.Client(timeout=300) as client:
        # the replicas, learnt from answers to keys of our own (no model run)
        seen = {stats(client, url, f"probe-{i}")[0] for i in range(40)}
        assert len(seen) == 2, seen
        replicas = sorted(seen)

        # two document sets that the ranking places on different replicas (computed here, from the keys alone)
        def docs_of(ex: dict[str, Any]) -> list[dict[str, Any]]:
            return [{"id": d["id"], "title": d["title"], "text": d["text"]} for d in hotpot_docs(ex)]

        def home(ex: dict[str, Any]) -> str:
            key = routing_key(body(ex["question"], docs_of(ex)))
            assert key is not None
            return rank_replicas(key, replicas)[0]

        first = examples[0]
        second = next(ex for ex in examples[1:] if home(ex) != home(first))
        questions = ["Which of these is the oldest?", "Who is mentioned first?"]
        served: dict[str, set[str]] = {}
        for ex in (first, second):
            for question in [ex["question"], *questions]:
                r = client.post(f"{url}/v1/compress", content=body(question, docs_of(ex), ratio=0.33))
                assert r.status_code == 200, r.text
                out = r.json()
                assert out["status"] == "optimized" and out["tier"] == "model" and out["encoding"] == "parallel"
                assert out["tokens_after"] < out["tokens_before"]
                served.setdefault(ex["_id"], set()).add(r.headers["x-ragopt-replica"])
        assert served == {first["_id"]: {home(first)}, second["_id"]: {home(second)}}  # each set sticks to one
        assert {home(first), home(second)} == set(replicas)  # and both replicas serve

        # the memory tier of the first set's replica is warm: its later questions read the documents there
        a, b = home(first), home(second)
        _, a_stats = stats(client, url, key_for(a, replicas))
        assert a_stats["encoding_cache"]["memory_hits"] >= len(questions) * len(docs_of(first))

        # a chat request over the same documents (<document> blocks) goes to the same replica, streamed back
        fake, _ = upstream
        fake.gate.clear()
        content = f"{blocks(docs_of(first))}\n\nQuestion: {first['question']}"
        chat = {"model": "gated", "stream": True, "messages": [{"role": "user", "content": content}]}
        with client.stream("POST", f"{url}/v1/chat/completions", json=chat) as r:
            assert r.status_code == 200 and r.headers["x-ragopt-replica"] == a
            assert r.headers["x-ragopt-status"] == "optimized"
            chunks = r.iter_bytes()
            head = next(chunks)  # the first event arrives while the upstream still holds the rest
            assert b"Hel" in head and fake.gate_released is None
            fake.gate.set()
            rest = b"".join(chunks)
        assert b"[DONE]" in head + rest and fake.gate_released is True

        # the first set, read by the other replica (reached by its routing key): its documents come from Redis
        deadline = time.monotonic() + 120  # the shared tier is written behind: wait for the writes to land
        while redis_server.client().dbsize() < 2 * (len(docs_of(first)) + len(docs_of(second))):
            assert time.monotonic() < deadline, "the replicas' encodings did not reach redis"
            time.sleep(0.1)
        _, before = stats(client, url, key_for(b, replicas))
        r = client.post(
            f"{url}/v1/compress",
            content=body(first["question"], docs_of(first), ratio=0.33),
            headers={"x-ragopt-routing-key": key_for(b, replicas)},
        )
        assert r.status_code == 200 and r.headers["x-ragopt-replica"] == b, r.text
        out = r.json()
        assert out["status"] == "optimized" and out["cache_misses"] == 0
        assert out["cache_hits"] == len(docs_of(first))
        _, after = stats(client, url, key_for(b, replicas))
        shared = after["encoding_cache"]["shared_hits"] - before["encoding_cache"]["shared_hits"]
        memory = after["encoding_cache"]["memory_hits"] - before["encoding_cache"]["memory_hits"]
        # (each document is two entries, its states and its sentence ends' queries; the prompt's prefix, which every
        # request shares, was already in that replica's memory)
        assert shared >= len(docs_of(first)) and memory < len(docs_of(first)), (shared, memory)


@pytest.mark.slow
def test_the_ingress_relays_every_route_and_the_apps_limits(ray_app: str) -> None:
    url = ray_app
    with httpx.Client(timeout=60) as client:
        r = client.get(f"{url}/readyz")
        assert r.status_code == 200 and r.json()["optimizer"] == "ready" and r.headers["x-ragopt-replica"]
        r = client.get(f"{url}/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        big = body("q", [{"id": "x", "text": "word " * 60_000}])  # over --max-body-bytes (256 KiB)
        r = client.post(f"{url}/v1/compress", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        r = client.get(f"{url}/v1/compress")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
