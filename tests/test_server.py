"""The OpenAI-compatible proxy, end to end: uvicorn on 127.0.0.1, the official ``openai`` client (sync, async,
streaming and not), a recording OpenAI-compatible upstream (tests/upstream_server.py) and the real embedded
proxy model for every optimization.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from rag_opt.install import install_hint
from rag_opt.server.settings import ProxySettings
from rag_opt.types import OptimizeResult, OutputDocument
from rag_opt.wire.chat import plan_request
from rag_opt.wire.errors import RequestError
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, assert_verbatim, blocks
from tests.upstream_server import (
    ERROR_400,
    ERROR_500,
    STREAM_ERROR,
    BudgetClock,
    FakeUpstream,
    ServerThread,
    parse_metrics,
    serve_proxy,
    upstream_pool_is_clean,
)

ALL_DOCS = EXAMPLE_DOCS
DOCS = ALL_DOCS[:3]
QUESTION = EXAMPLE_QUESTION
INSTRUCTION = "Answer from these documents only.\n\n"
BLOCK = re.compile(r"<document(?P<attrs>[^>]*)>(?P<body>.*?)</document>", re.DOTALL)


def user_content(docs: list[dict[str, Any]] = DOCS) -> str:
    return f"{INSTRUCTION}{blocks(docs)}\n\nQuestion: {QUESTION}"


def assert_compressed(original: str, new: str, docs: list[dict[str, Any]] = DOCS) -> None:
    """``new`` keeps the text around the blocks, and every kept block is its document's sentences, verbatim."""
    assert new.startswith(INSTRUCTION) and new.endswith(f"\n\nQuestion: {QUESTION}")
    by_tag = {f' id="{d["id"]}" title="{d["title"]}"': d["text"] for d in docs}
    kept = BLOCK.findall(new)
    assert kept, "every document was dropped"
    assert len(kept) <= len(docs)
    for attrs, body in kept:
        source = by_tag[attrs]
        assert body.startswith("\n") and body.endswith("\n")
        assert_verbatim(body.strip(), source)
    assert len(new) < len(original)


class RaisingOptimizer:
    """An optimizer whose ``optimize`` fails: the proxy must fail open."""

    calls = 0

    def optimize(self, query: str, documents: Any, **kwargs: Any) -> OptimizeResult:
        self.calls += 1
        raise RuntimeError("injected optimizer failure")


# -- servers ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str, ServerThread]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url, server


@pytest.fixture(scope="module")
def optimizer() -> Any:
    from rag_opt import ContextOptimizer

    return ContextOptimizer()  # the real embedded model; loaded by the first optimization


@pytest.fixture(scope="module")
def proxy(upstream: tuple[FakeUpstream, str, ServerThread], optimizer: Any) -> Iterator[tuple[str, Any]]:
    with serve_proxy(upstream[1], optimizer) as p:
        yield p


@pytest.fixture
def up(upstream: tuple[FakeUpstream, str, ServerThread]) -> FakeUpstream:
    fake = upstream[0]
    fake.gate.clear()
    fake.gate_released = None
    return fake


@pytest.fixture
def client(proxy: tuple[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy[0]}/v1", api_key="sk-client", max_retries=0, timeout=None)


@pytest.fixture
def aclient(proxy: tuple[str, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{proxy[0]}/v1", api_key="sk-client", max_retries=0, timeout=None)


# -- optimization through the real client -------------------------------------------------------------------
@pytest.mark.model
def test_sync_chat_compresses_document_blocks_and_forwards_the_rest_unchanged(client, up):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Earlier question with <document>old context. It stays.</document>"},
        {"role": "assistant", "content": "Earlier answer."},
        {"role": "user", "content": user_content()},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model="fake-llm", messages=messages, temperature=0.25, max_tokens=7, user="u-1"
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "ok"
    before, after = int(raw.headers["x-ragopt-tokens-before"]), int(raw.headers["x-ragopt-tokens-after"])
    assert raw.headers["x-ragopt-status"] == "optimized"
    assert 0 < after <= before // 2  # default ratio 0.5
    assert float(raw.headers["x-ragopt-optimizer-ms"]) > 0

    got = up.last().json()
    assert {k: v for k, v in got.items() if k != "messages"} == {
        "model": "fake-llm",
        "max_tokens": 7,
        "temperature": 0.25,
        "user": "u-1",
    }
    assert got["messages"][:3] == messages[:3]  # system prompt and earlier turns untouched
    assert_compressed(messages[3]["content"], got["messages"][3]["content"])
    assert up.last().header("authorization") == "Bearer sk-client"


@pytest.mark.model
def test_raw_body_is_byte_identical_outside_the_compressed_documents(proxy, up):
    """Whitespace, number formats, escapes and key order survive; only the content string and rag_opt change."""
    content = user_content(DOCS[:2])
    prefix = (
        b'{ "model" : "fake-llm",\n  "messages": [ {"role": "system", "content": "Sys \\u00e9\\/ prompt"},\n'
        b'   {"role":"user","name":"x","content":'
    )
    suffix = (
        b'} ],\n "temperature": 1.0E0, "top_p": 0.10, "metadata": {"k": [1, 2.50, null, true, "\\u2028"]},\n'
        b' "rag_opt": {"ratio": 0.4}, "n": 1 }'
    )
    body = prefix + json.dumps(content).encode() + suffix
    r = httpx.post(
        f"{proxy[0]}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=None
    )
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    got = up.last().body
    expected_suffix = suffix.replace(b'"rag_opt": {"ratio": 0.4}, ', b"")
    assert got.startswith(prefix) and got.endswith(expected_suffix)
    new_content = json.loads(got[len(prefix) : len(got) - len(expected_suffix)])
    assert_compressed(content, new_content, DOCS[:2])
    before, after = int(r.headers["x-ragopt-tokens-before"]), int(r.headers["x-ragopt-tokens-after"])
    assert after <= int(0.4 * before)
    assert up.last().header("content-length") == str(len(got))


@pytest.mark.model
def test_async_chat_with_extension_documents(aclient, up):
    async def go() -> Any:
        return await aclient.chat.completions.with_raw_response.create(
            model="fake-llm",
            messages=[{"role": "user", "content": QUESTION}],
            extra_body={"rag_opt": {"documents": DOCS[:2], "target_tokens": 120, "ordering": "relevance"}},
        )

    raw = asyncio.run(go())
    assert raw.parse().choices[0].message.content == "ok"
    assert int(raw.headers["x-ragopt-tokens-after"]) <= 120 < int(raw.headers["x-ragopt-tokens-before"])
    got = up.last().json()
    assert "rag_opt" not in got
    content = got["messages"][0]["content"]
    assert content.endswith("\n\n" + QUESTION)
    rendered = content[: -len("\n\n" + QUESTION)]
    kept = re.findall(r'<document id="([^"]*)" title="[^"]*">(.*?)</document>', rendered, re.DOTALL)
    assert kept and len(kept) <= 3
    texts = {d["id"]: d["text"] for d in DOCS[:2]}
    for doc_id, text in kept:
        assert_verbatim(text, texts[doc_id])


@pytest.mark.model
def test_headers_override_budget_and_are_not_forwarded(client, up):
    raw = client.chat.completions.with_raw_response.create(
        model="fake-llm",
        messages=[{"role": "user", "content": user_content(DOCS[:2])}],
        extra_headers={"x-ragopt-target-tokens": "80", "x-ragopt-ordering": "lost_in_the_middle", "x-custom": "kept"},
    )
    assert int(raw.headers["x-ragopt-tokens-after"]) <= 80
    rec = up.last()
    assert not [k for k, _ in rec.headers if k.startswith("x-ragopt-")]
    assert rec.header("x-custom") == "kept" and rec.header("authorization") == "Bearer sk-client"
    assert_compressed(user_content(DOCS[:2]), rec.json()["messages"][0]["content"], DOCS[:2])


@pytest.mark.model
def test_large_tool_message_is_compressed_and_tool_calls_untouched(client, up):
    tool_text = "\n\n".join(d["text"] for d in DOCS[:2])
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "2014 S/S"}'}}
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": tool_text},
    ]
    raw = client.chat.completions.with_raw_response.create(model="fake-llm", messages=messages)
    assert raw.headers["x-ragopt-status"] == "optimized"
    got = up.last().json()["messages"]
    assert got[:2] == messages[:2] and got[2]["tool_call_id"] == "call_1"
    new = got[2]["content"]
    assert 0 < len(new) < len(tool_text)
    assert_verbatim(new, tool_text)


@pytest.mark.model
def test_sync_streaming_relays_chunks_as_they_arrive(client, up):
    stream = client.chat.completions.create(
        model="gated", messages=[{"role": "user", "content": user_content(DOCS[:2])}], stream=True
    )
    chunks = iter(stream)
    first = next(chunks)  # the upstream is still holding the rest back
    assert first.choices[0].delta.content == "Hel"
    assert up.gate_released is None
    up.gate.set()
    rest = list(chunks)  # ends on data: [DONE]
    assert up.gate_released is True
    assert "".join(c.choices[0].delta.content or "" for c in rest) == "lo"
    assert rest[-1].choices[0].finish_reason == "stop"
    assert stream.response.headers["x-ragopt-status"] == "optimized"
    assert_compressed(user_content(DOCS[:2]), up.last().json()["messages"][0]["content"], DOCS[:2])


def test_async_streaming_relays_chunks_as_they_arrive(aclient, up):
    async def go() -> tuple[str, list[Any]]:
        stream = await aclient.chat.completions.create(
            model="gated", messages=[{"role": "user", "content": "Say hello."}], stream=True
        )
        first = await stream.__anext__()
        assert up.gate_released is None
        up.gate.set()
        return first.choices[0].delta.content or "", [c async for c in stream]

    first, rest = asyncio.run(go())
    assert first == "Hel" and up.gate_released is True
    assert "".join(c.choices[0].delta.content or "" for c in rest) == "lo"


def test_client_disconnect_closes_the_upstream_stream(proxy, upstream, up):
    server_state = upstream[2].server.server_state

    def open_upstream_connection() -> bool:
        return any(getattr(c, "client", None) == up.last().client for c in list(server_state.connections))

    with httpx.Client() as c:
        body = {"model": "gated", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with c.stream("POST", f"{proxy[0]}/v1/chat/completions", json=body) as r:
            chunks = r.iter_raw()  # (kept: a discarded generator would close the response at once)
            assert next(chunks).startswith(b"data: ")
            assert open_upstream_connection()
            assert not upstream_pool_is_clean(proxy[1])
    deadline = time.monotonic() + 60  # a bound, not a speed budget
    while open_upstream_connection() and time.monotonic() < deadline:  # the client left mid-stream
        time.sleep(0.05)
    assert not open_upstream_connection()  # so the proxy closed its upstream stream
    while not upstream_pool_is_clean(proxy[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream_pool_is_clean(proxy[1])  # and left nothing behind in its connection pool
    up.gate.set()


# -- pass-through and errors --------------------------------------------------------------------------------
def test_request_without_context_is_forwarded_byte_for_byte(proxy, up):
    body = (
        b'{"model":"fake-llm",  "messages":[{"role":"system","content":"No docs \\u00e9 here"},'
        b'{"role":"user","content":"old <document>turn</document>"},{"role":"assistant","content":"a"},'
        b'{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:x"}}]},'
        b'{"role":"tool","tool_call_id":"c","content":"short tool result"}],\n"temperature":1E0 }'
    )
    r = httpx.post(f"{proxy[0]}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.headers["x-ragopt-status"] == "no_context"
    assert up.last().body == body
    assert r.headers["x-ragopt-tokens-before"] == "0"


def test_models_embeddings_and_completions_pass_through(client, proxy, up):
    assert [m.id for m in client.models.list()] == ["fake-llm"]
    assert up.last("/v1/models").method == "GET"
    emb = client.embeddings.create(model="fake-emb", input="hello")
    assert emb.data[0].embedding == [0.5, -0.25]
    assert up.last("/v1/embeddings").json()["input"] == "hello"
    body = b'{"model": "fake-llm", "prompt": "<document>Not touched. Never.</document> Q?", "max_tokens": 3}'
    r = httpx.post(f"{proxy[0]}/v1/completions?x=1", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    assert up.last("/v1/completions").body == body and up.last("/v1/completions").query == "x=1"
    assert "x-ragopt-status" not in r.headers


def test_hop_by_hop_host_and_content_length_are_not_forwarded(proxy, upstream, up):
    headers = {
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Proxy-Authorization": "Basic secret",
        "Connection": "keep-alive, X-Drop-Me",
        "X-Drop-Me": "1",
        "X-Keep-Me": "1",
        "Content-Type": "application/json",
    }
    body = b'{"model": "fake-llm", "messages": [{"role": "user", "content": "hi"}]}'
    r = httpx.post(f"{proxy[0]}/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 200
    rec = up.last()
    names = {k for k, _ in rec.headers}
    assert not names & {"keep-alive", "te", "proxy-authorization", "x-drop-me"}
    assert rec.header("x-keep-me") == "1"
    assert rec.header("host") == upstream[1].removeprefix("http://")
    assert rec.header("content-length") == str(len(body))
    assert rec.header("user-agent") == r.request.headers["user-agent"]


def test_upstream_errors_reach_the_client_as_the_sdk_expects(client, proxy, up):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="error-400", messages=[{"role": "user", "content": "hi"}])
    assert bad.value.status_code == 400 and bad.value.code == "bad" and bad.value.body == ERROR_400["error"]
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="error-500", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 500 and err.value.body == ERROR_500["error"]
    r = httpx.post(f"{proxy[0]}/v1/chat/completions", json={"model": "error-400", "messages": []})
    assert r.status_code == 400 and r.content == json.dumps(ERROR_400).encode()


def test_mid_stream_error_event_and_dropped_stream(client, proxy):
    stream = client.chat.completions.create(
        model="stream-error", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.content == "Hel"
    with pytest.raises(openai.APIError, match="upstream exploded mid-stream") as exc:
        next(chunks)
    assert exc.value.body == STREAM_ERROR["error"]

    before = parse_metrics(httpx.get(f"{proxy[0]}/metrics").text)
    stream = client.chat.completions.create(
        model="stream-drop", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.content == "Hel"
    with pytest.raises(openai.APIConnectionError):
        list(chunks)  # a broken stream, not a clean (truncated) end
    after = parse_metrics(httpx.get(f"{proxy[0]}/metrics").text)
    assert (
        after['ragopt_upstream_errors_total{kind="stream"}']
        == before['ragopt_upstream_errors_total{kind="stream"}'] + 1
    )


def test_bad_rag_opt_input_is_a_clear_400_and_not_forwarded(client, proxy, up):
    n = len(up.requests)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="fake-llm", messages=[{"role": "user", "content": "hi"}], extra_body={"rag_opt": {"ratio": 3}}
        )
    assert exc.value.code == "invalid_rag_opt" and "ratio must be in (0, 1]" in exc.value.message
    with pytest.raises(openai.BadRequestError, match="unknown ordering"):
        client.chat.completions.create(
            model="fake-llm", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-ragopt-ordering": "up"}
        )
    r = httpx.post(f"{proxy[0]}/v1/chat/completions", json={"messages": [], "rag_opt": {"documents": [{"x": 1}]}})
    assert r.status_code == 400
    assert (
        r.json()["error"]["type"] == "invalid_request_error" and "rag_opt.documents[0]" in r.json()["error"]["message"]
    )
    assert len(up.requests) == n
    r = httpx.get(f"{proxy[0]}/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{proxy[0]}/healthz").json()["status"] == "ok"


def test_unreachable_upstream_is_a_502(optimizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with serve_proxy(dead, optimizer, connect_timeout=2) as (url, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.InternalServerError) as exc:
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert exc.value.status_code == 502 and exc.value.code == "upstream_unavailable"


def test_an_unreachable_upstream_is_logged_with_its_url_without_credentials(optimizer, caplog):
    caplog.set_level(logging.WARNING, logger="rag_opt.server.upstream")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serve_proxy(f"http://ops:hunter2@127.0.0.1:{port}", optimizer, connect_timeout=2) as (url, _):
        assert httpx.get(f"{url}/v1/models?key=query-secret", timeout=60).status_code == 502
    lines = [r.getMessage() for r in caplog.records if r.name == "rag_opt.server.upstream"]
    expected = f"upstream failed: http://***@127.0.0.1:{port}/v1/models could not be reached"
    assert any(expected in m for m in lines), lines
    assert not any("hunter2" in m or "query-secret" in m for m in lines)


def test_operator_key_replaces_client_authorization(upstream, optimizer, up):
    with serve_proxy(upstream[1], optimizer, upstream_api_key="sk-operator") as (url, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-client", max_retries=0)
        c.models.list()
    rec = up.last("/v1/models")
    assert rec.header("authorization") == "Bearer sk-operator"
    assert [v for k, v in rec.headers if k == "authorization"] == ["Bearer sk-operator"]


# -- fail-open ------------------------------------------------------------------------------------------------
def test_fail_open_on_injected_optimizer_failure(upstream, up):
    failing = RaisingOptimizer()
    with serve_proxy(upstream[1], failing) as (url, state):
        body = json.dumps({"model": "fake-llm", "messages": [{"role": "user", "content": user_content()}]}).encode()
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "fail_open"
        assert up.last().body == body  # the original request, unchanged
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        ext = {"rag_opt": {"documents": ["Doc one. Doc two."]}}
        out = c.chat.completions.create(model="fake-llm", messages=[{"role": "user", "content": "Q?"}], extra_body=ext)
        assert out.choices[0].message.content == "ok"
        got = up.last().json()
        assert "rag_opt" not in got and got["messages"][0]["content"] == "<document>Doc one. Doc two.</document>\n\nQ?"
        metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
    assert failing.calls == 2
    assert metrics['ragopt_fail_open_total{reason="error"}'] == 2
    assert metrics['ragopt_chat_requests_total{outcome="fail_open"}'] == 2


class BlockingOptimizer:
    """An optimizer that runs until the test releases it (a proxy model slower than any budget)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def optimize(self, query: str, documents: Any, **kwargs: Any) -> OptimizeResult:
        self.started.set()
        assert self.release.wait(300)
        raise RuntimeError("released")


def test_fail_open_on_time_budget(upstream, up):
    opt = BlockingOptimizer()
    clock = BudgetClock()  # the budget runs out when the test says so
    with serve_proxy(upstream[1], opt, time_budget_ms=30) as (url, state):
        clock.install(state)
        body = json.dumps({"model": "fake-llm", "messages": [{"role": "user", "content": user_content()}]}).encode()
        answer: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: answer.append(
                httpx.post(
                    f"{url}/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=300,
                )
            )
        )
        t.start()
        assert opt.started.wait(300)
        clock.expire()
        t.join(300)
        r = answer[0]  # answered while the optimization still runs: the client did not wait for it
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "fail_open"
        assert r.headers["x-ragopt-reason"] == "timeout" and up.last().body == body
        metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
        assert metrics['ragopt_fail_open_total{reason="timeout"}'] == 1
        assert metrics['ragopt_optimizer_timeouts_total{stage="running"}'] == 1 and state.pool.gauges()[1] == 1
        opt.release.set()
        deadline = time.monotonic() + 300
        while state.pool.gauges()[1] and time.monotonic() < deadline:  # the abandoned optimization finishes
            time.sleep(0.01)
        metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
        assert metrics["ragopt_optimizer_abandoned_finished_total"] == 1


# -- metrics ----------------------------------------------------------------------------------------------------
@pytest.mark.model
def test_metrics_change_with_traffic(client, proxy):
    r0 = httpx.get(f"{proxy[0]}/metrics")
    assert r0.headers["content-type"].startswith("text/plain; version=0.0.4")
    m0 = parse_metrics(r0.text)
    client.chat.completions.create(model="fake-llm", messages=[{"role": "user", "content": "Nothing to optimize."}])
    client.chat.completions.create(model="fake-llm", messages=[{"role": "user", "content": user_content(DOCS[:2])}])
    m1 = parse_metrics(httpx.get(f"{proxy[0]}/metrics").text)

    def delta(name: str) -> float:
        return m1[name] - m0.get(name, 0.0)

    assert delta('ragopt_requests_total{route="chat_completions"}') == 2
    assert delta('ragopt_chat_requests_total{outcome="no_context"}') == 1
    assert delta('ragopt_chat_requests_total{outcome="optimized"}') == 1
    assert delta('ragopt_upstream_responses_total{code="200"}') == 2
    assert delta("ragopt_optimizer_latency_seconds_count") == 1 and delta("ragopt_optimizer_latency_seconds_sum") > 0
    assert delta("ragopt_tokens_before_total") > delta("ragopt_tokens_after_total") > 0
    assert delta("ragopt_documents_before_total") == 2
    assert m1["ragopt_optimizations_in_flight"] == 0


# -- context finding and in-place writing (no server) ----------------------------------------------------------
def _result(kept: list[tuple[int, str]], dropped: list[int]) -> OptimizeResult:
    def doc(i: int, t: str) -> OutputDocument:
        return OutputDocument(id=str(i), index=i, text=t)

    return OptimizeResult(
        query="q",
        documents=[doc(i, t) for i, t in kept],
        dropped=[doc(i, "") for i in dropped],
        tokens_before=2,
        tokens_after=1,
        target_tokenizer="o200k_base",
        scorer="probe",
    )


def test_blocks_are_found_and_rewritten_in_place():
    content = "Use these:\n<DOC id='a' title=\"A &amp; B\">\n One. Two. \n</DOC>\n<doc>Three.</doc>\n\nQuestion: why?"
    raw = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
    plan = plan_request(raw, {}, tag="doc")
    assert plan is not None and plan.query == "Use these:\nQuestion: why?"
    assert [(d.id, d.title, d.text) for d in plan.documents] == [("a", "A & B", "One. Two."), (None, None, "Three.")]
    assert plan.render(None) == raw

    def rendered(result: OptimizeResult) -> str:
        return json.loads(plan.render(result))["messages"][0]["content"]

    assert rendered(_result([(0, "Two."), (1, "Three.")], [])) == content.replace(" One. Two. ", " Two. ")
    assert rendered(_result([(1, "Three.")], [0])) == "Use these:\n<doc>Three.</doc>\n\nQuestion: why?"
    assert (
        rendered(_result([(0, "One.")], [1]))
        == "Use these:\n<DOC id='a' title=\"A &amp; B\">\n One. \n</DOC>\n\nQuestion: why?"
    )
    swapped = rendered(_result([(1, "Three."), (0, "One. Two.")], []))
    assert (
        swapped
        == "Use these:\n<doc>Three.</doc>\n<DOC id='a' title=\"A &amp; B\">\n One. Two. \n</DOC>\n\nQuestion: why?"
    )
    with pytest.raises(RuntimeError):
        plan.render(_result([(0, "One.")], []))  # a result that does not cover every document


def test_where_context_is_looked_for():
    long_tool = "Tool sentence number one. " * 20
    messages = [
        {"role": "system", "content": "<document>In the system prompt.</document>"},
        {"role": "user", "content": "<document>Earlier turn: not context.</document> q0"},
        {"role": "assistant", "content": "<document>Assistant: not context.</document>"},
        {"role": "tool", "content": long_tool},  # before the last user message: an earlier turn
        {"role": "user", "content": [{"type": "text", "text": "<document>Current turn.</document> q1"}]},
        {"role": "tool", "content": long_tool},
        {"role": "tool", "content": "small"},
    ]
    plan = plan_request(json.dumps({"messages": messages}).encode(), {}, tool_min_chars=100)
    assert plan is not None and plan.query == "q1"
    found = [(plan.containers[d.container].path[1], d.text) for d in plan.documents if d.container is not None]
    assert found == [(0, "In the system prompt."), (4, "Current turn."), (5, long_tool.strip())]
    assert plan_request(json.dumps({"messages": messages}).encode(), {}, tool_messages=False).documents[-1].text == (
        "Current turn."
    )


@pytest.mark.parametrize(
    ("kept", "expected"),
    [
        ([0, 1, 2], "X:\n<d>A.</d>\n<d>B.</d>\n<d>C.</d>\n\nQ?"),
        ([1], "X:\n<d>B.</d>\n\nQ?"),
        ([0], "X:\n<d>A.</d>\n\nQ?"),
        ([2], "X:\n<d>C.</d>\n\nQ?"),
        ([0, 2], "X:\n<d>A.</d>\n<d>C.</d>\n\nQ?"),
        ([], "X:\n\nQ?"),
    ],
)
def test_dropped_blocks_go_with_their_separator(kept, expected):
    content = "X:\n<d>A.</d>\n<d>B.</d>\n<d>C.</d>\n\nQ?"
    plan = plan_request(json.dumps({"messages": [{"role": "user", "content": content}]}).encode(), {}, tag="d")
    texts = ["A.", "B.", "C."]
    result = _result([(i, texts[i]) for i in kept], [i for i in range(3) if i not in kept])
    assert json.loads(plan.render(result))["messages"][0]["content"] == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"rag_opt": {}, "messages": []}', b'{"messages": []}'),
        (b'{"messages": [] , "rag_opt" : {"ratio": 0.5} }', b'{"messages": [] }'),
        (b'{"messages": [], "rag_opt": {}, "b": [2.50]}', b'{"messages": [], "b": [2.50]}'),
    ],
)
def test_extension_field_is_removed_leaving_the_other_bytes(body, expected):
    plan = plan_request(body, {})
    assert plan is not None and plan.render(None) == expected


def test_a_repeated_extension_field_is_refused():
    # rag-opt would read the last one and an upstream might read the first: neither is guessed
    with pytest.raises(RequestError, match="more than once") as exc:
        plan_request(b'{ "rag_opt": {"enabled": false}, "rag_opt": {}, "messages": [ ] }', {})
    assert exc.value.code == "duplicate_key" and exc.value.param == "rag_opt"


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b"not json", "invalid_json", "not valid JSON"),
        (b"[1, 2]", "invalid_json", "must be a JSON object, got an array"),
        (b'{"x": "\xff"}', "invalid_encoding", "not valid UTF-8"),
        (b'{"model": "m"}', "missing_required_parameter", "'messages'"),
        (b'{"messages": {"role": "user"}}', "invalid_type", "'messages' must be an array"),
        (b'{"messages": [{"content": "hi"}]}', "missing_required_parameter", "messages[0].role is missing"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "invalid_type", "messages[0].content must be"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}', "invalid_type", "text must"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json", "nested too deeply"),
    ],
)
def test_invalid_bodies_are_clear_client_errors(body, code, message):
    with pytest.raises(RequestError, match=re.escape(message)) as exc:
        plan_request(body, {})
    assert exc.value.code == code


def test_unknown_rag_opt_header_is_an_error():
    with pytest.raises(RequestError, match="x-ragopt-nope"):
        plan_request(b"{}", {"X-RagOpt-Nope": "1"})


# -- settings, CLI, imports -----------------------------------------------------------------------------------
def test_settings_from_environment_and_command_line():
    env = {"RAG_OPT_UPSTREAM": "http://up:1/v1/", "RAG_OPT_RATIO": "0.3", "RAG_OPT_TIME_BUDGET_MS": "250"}
    s = ProxySettings.from_sources({}, env)
    assert (s.upstream, s.ratio, s.time_budget_ms, s.port) == ("http://up:1/v1", 0.3, 250.0, 8000)
    s = ProxySettings.from_sources({"target_tokens": 500, "port": 9}, env)
    assert s.budget.as_kwargs() == {"ratio": None, "target_tokens": 500, "threshold": None} and s.port == 9
    assert ProxySettings.from_sources({"upstream": "http://x"}, {}).ratio == 0.5
    with pytest.raises(ValueError, match=r"invalid ratio \(from RAG_OPT_RATIO\)"):
        ProxySettings.from_sources({}, {**env, "RAG_OPT_RATIO": "2"})
    with pytest.raises(ValueError, match="no upstream"):
        ProxySettings.from_sources({}, {})
    secret = ProxySettings(upstream="http://x", upstream_api_key="sk-secret")
    assert "sk-secret" not in repr(secret) and "sk-secret" not in str(secret.model_dump())


def test_serve_flags_are_generated_from_the_settings(capsys):
    import argparse

    from rag_opt.cli import build_parser
    from rag_opt.server.settings_cli import add_settings_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(flags) == set(ProxySettings.model_fields)  # one flag per setting, each with help text
    assert all(a.help for a in flags.values())
    assert flags["proxy_model"].option_strings == ["--model"]
    assert flags["tool_messages"].option_strings == ["--no-tool-messages"]
    assert flags["warmup"].option_strings == ["--no-warmup"]
    assert flags["log_bodies"].option_strings == ["--log-bodies"]
    assert flags["trust_remote_code"].option_strings == ["--trust-remote-code"]
    args = parser.parse_args(["--upstream", "http://x/v1", "--model", "m.gguf", "--no-warmup", "--target-tokens", "9"])
    env = {"RAG_OPT_RATIO": "0.3", "RAG_OPT_PORT": "9", "RAG_OPT_UPSTREAM": "http://env/v1"}
    s = settings_from_args(args, env)  # the command line wins over the environment
    assert (s.upstream, s.proxy_model, s.warmup, s.port) == ("http://x/v1", "m.gguf", False, 9)
    assert s.budget.as_kwargs() == {"ratio": None, "target_tokens": 9, "threshold": None}
    with pytest.raises(SystemExit):
        parser.parse_args(["--ratio", "0.5", "--threshold", "0.2"])  # one budget at most
    with pytest.raises(ValueError, match=r"invalid ratio \(from --ratio\)"):
        settings_from_args(parser.parse_args(["--upstream", "http://x/v1", "--ratio", "2"]), {})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    serve_help = capsys.readouterr().out
    assert all(a.option_strings[0] in serve_help for a in flags.values())


def test_the_start_up_line_names_only_the_upstreams_configured():
    from rag_opt.cli.serve import startup_line

    plain = startup_line(ProxySettings(upstream="http://user:pw@llm.local:8080/v1"))
    assert plain.startswith("rag-opt proxy on http://127.0.0.1:8000/v1 -> http://***@llm.local:8080/v1 (")
    assert "Gemini" not in plain and "googleapis" not in plain and "pw" not in plain
    gemini = startup_line(ProxySettings(upstream="http://llm.local/v1", gemini_upstream="http://gem.local:9000"))
    assert "-> http://llm.local/v1, the Gemini API's paths (/v1beta/...) -> http://gem.local:9000 (" in gemini
    # from the environment too: configured is configured, wherever it was set
    from rag_opt.server.settings import ENV_PREFIX

    env = {ENV_PREFIX + "UPSTREAM": "http://llm.local/v1", ENV_PREFIX + "GEMINI_UPSTREAM": "http://gem.local:9000"}
    assert "-> http://gem.local:9000" in startup_line(ProxySettings.from_sources({}, env))


def test_serve_without_the_server_extra_says_what_to_install(monkeypatch, capsys):
    from rag_opt.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", "--upstream", "http://localhost:1/v1"]) == 2
    assert install_hint("server") in capsys.readouterr().err


def test_importing_the_proxy_does_not_import_torch():
    code = (
        "import sys, rag_opt.server.app, rag_opt.wire.documents; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_rag_opt_serve_command_runs_the_proxy(upstream, up):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAG_OPT_UPSTREAM": f"{upstream[1]}/v1", "RAG_OPT_PORT": str(port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rag_opt.cli", "serve", "--no-warmup", "--ratio", "0.4"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 300  # a bound on start-up, not a speed budget
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz")
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "rag-opt serve did not start"
                time.sleep(0.2)
        assert health.json() == {"status": "ok", "optimizer": "cold", "mode": "optimizing"}
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert [m.id for m in c.models.list()] == ["fake-llm"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert b"ratio=0.4" in err
