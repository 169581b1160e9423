"""The Anthropic Messages (``/v1/messages``) and OpenAI Responses (``/v1/responses``) routes, end to end: uvicorn
on 127.0.0.1, the official ``anthropic`` and ``openai`` clients (streaming and not), a recording upstream
(tests/upstream_server.py) and the real embedded proxy model for every optimization.

Byte identity is checked against the bytes the SDK itself sent (captured by an httpx event hook): every byte
outside the context values is the same upstream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import httpx2  # the HTTP client the SDKs are built on
import openai
import pytest

from rag_opt.server.settings import ProxySettings
from rag_opt.types import OptimizeResult, OutputDocument
from rag_opt.wire.anthropic_messages import plan_messages
from rag_opt.wire.documents import ContextPlan
from rag_opt.wire.json_edit import JsonPath
from rag_opt.wire.responses import plan_responses
from tests.helpers import (
    EXAMPLE_DOCS,
    EXAMPLE_QUESTION,
    Recording,
    assert_only_context_changed,
    assert_optimized,
    blocks,
    value,
)
from tests.upstream_server import FakeUpstream, ServerThread, parse_metrics, serve_proxy

DOCS = EXAMPLE_DOCS[:2]
QUESTION = EXAMPLE_QUESTION
TOOL_OUTPUT = " ".join(d["text"] for d in EXAMPLE_DOCS[2:4])  # over the tests' --tool-min-chars (300)
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"


def question_with_blocks() -> str:
    return f"Answer from these documents only.\n\n{blocks(DOCS)}\n\nQuestion: {QUESTION}"


# -- servers and clients --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        fake.url = server.url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture(scope="module")
def proxy(upstream: FakeUpstream) -> Iterator[str]:
    from rag_opt import ContextOptimizer

    # the real embedded model (loaded once per process, shared with the other server tests)
    with serve_proxy(upstream.url, ContextOptimizer(), ordering="input") as (url, _):  # type: ignore[attr-defined]
        yield url


@pytest.fixture
def up(upstream: FakeUpstream) -> FakeUpstream:
    upstream.gate.clear()
    upstream.gate_released = None
    return upstream


@pytest.fixture
def sent() -> list[bytes]:
    """The request bodies the SDK clients below sent, in order."""
    return []


def _recording(sent: list[bytes]) -> httpx2.Client:
    return httpx2.Client(timeout=None, event_hooks={"request": [lambda r: sent.append(r.read())]})


@pytest.fixture
def claude(proxy: str, sent: list[bytes]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy, api_key="sk-ant-client", max_retries=0, http_client=_recording(sent))


@pytest.fixture
def gpt(proxy: str, sent: list[bytes]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy}/v1", api_key="sk-client", max_retries=0, http_client=_recording(sent))


def found(plan: ContextPlan) -> list[tuple[JsonPath, str, str | None]]:
    """Where each document of a plan is, its text's start and its title."""
    return [(plan.containers[d.container].path, d.text[:8], d.title) for d in plan.documents if d.container is not None]


# -- where the context is (no server) --------------------------------------------------------------------------
def test_where_messages_context_is_looked_for():
    long = "Tool sentence. " * 30
    body = {
        "system": "Be terse <document>Sys doc.</document>",
        "messages": [
            {"role": "user", "content": "<document>Earlier turn: not context.</document> q0"},
            {"role": "assistant", "content": "<document>Assistant: not context.</document>"},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t0", "content": long},  # in the question's message
                    {"type": "text", "text": '<document id="1">Doc one.</document> Q?'},
                    {"type": "document", "title": "T", "source": {"type": "text", "data": "Plain doc."}},
                    {"type": "document", "source": {"type": "base64", "data": "JVBERi0="}},  # a PDF: not text
                ],
            },
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": long}]},
                    {"type": "tool_result", "tool_use_id": "t", "content": "small"},
                    {"type": "tool_result", "tool_use_id": "t", "content": "<document>Tool doc.</document>"},
                ],
            },
        ],
    }
    settings = ProxySettings(upstream="http://127.0.0.1:9/v1", tool_min_chars=100)
    plan = plan_messages(json.dumps(body).encode(), {}, settings)
    assert plan.query == "Q?"
    assert found(plan) == [
        (("system",), "Sys doc.", None),
        (("messages", 2, "content", 0, "content"), "Tool sen", None),
        (("messages", 2, "content", 1, "text"), "Doc one.", None),
        (("messages", 2, "content", 2, "source", "data"), "Plain do", "T"),
        (("messages", 4, "content", 0, "content", 0, "text"), "Tool sen", None),
        (("messages", 4, "content", 2, "content"), "Tool doc", None),
    ]
    assert plan.render(None) == plan.raw  # nothing changes without a result
    off = ProxySettings(upstream="http://127.0.0.1:9/v1", tool_messages=False)
    assert len(plan_messages(json.dumps(body).encode(), {}, off).documents) == 4


def test_where_responses_context_is_looked_for():
    long = "Function sentence. " * 30
    items = [
        {"role": "system", "content": "<document>Sys doc.</document>"},
        {"role": "user", "content": "<document>Earlier turn: not context.</document> q0"},
        {"type": "function_call_output", "call_id": "c0", "output": long},  # an earlier turn
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<document>D1.</document> Q?"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": long},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": long}]},
        {"type": "function_call_output", "call_id": "c", "output": "small"},
    ]
    settings = ProxySettings(upstream="http://127.0.0.1:9/v1", tool_min_chars=100)
    plan = plan_responses(
        json.dumps({"instructions": "<document>Ins.</document>", "input": items}).encode(), {}, settings
    )
    assert plan.query == "Q?"
    assert found(plan) == [
        (("instructions",), "Ins.", None),
        (("input", 0, "content"), "Sys doc.", None),
        (("input", 3, "content", 0, "text"), "D1.", None),
        (("input", 5, "output"), "Function", None),
        (("input", 6, "output", 0, "text"), "Function", None),
    ]
    plain = plan_responses(b'{"input": "A question, no documents."}', {}, settings)
    assert plain.query == "A question, no documents." and not plain.documents


def test_messages_blocks_left_blank_are_removed_not_sent_empty():
    """The Messages API refuses empty text blocks: a block that held only dropped documents goes, with its comma;
    the last block of a list stays."""
    content = (
        '[{"type": "text", "text": "<document>Dropped one.</document>"}, {"type": "text", "text": "Q?"}, '
        '{"type": "document", "source": {"type": "text", "data": "Kept two. Cut."}}, '
        '{"type": "document", "source": {"type": "text", "data": "Dropped three."}}]'
    )
    raw = (
        '{"model": "m", "system": [{"type": "text", "text": "<document>Dropped sys.</document>"}], '
        f'"messages": [{{"role": "user", "content": {content}}}]}}'
    ).encode()
    plan = plan_messages(raw, {}, ProxySettings(upstream="http://127.0.0.1:9/v1"))
    assert [d.text for d in plan.documents] == ["Dropped sys.", "Dropped one.", "Kept two. Cut.", "Dropped three."]
    kept = OutputDocument(id="2", index=2, text="Kept two.")
    dropped = [OutputDocument(id=str(i), index=i, text="") for i in (0, 1, 3)]
    result = OptimizeResult(
        query="Q?",
        documents=[kept],
        dropped=dropped,
        tokens_before=9,
        tokens_after=3,
        target_tokenizer="o200k_base",
        scorer="probe",
    )
    assert plan.render(result) == (
        b'{"model": "m", "system": [{"type": "text", "text": ""}], "messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "Q?"}, {"type": "document", "source": {"type": "text", "data": "Kept two."}}]}]}'
    )


# -- Anthropic Messages API -----------------------------------------------------------------------------------
@pytest.mark.model
def test_messages_compress_document_blocks_and_text_documents_and_forward_the_rest_byte_for_byte(claude, sent, up):
    plain = EXAMPLE_DOCS[2]
    raw = claude.messages.with_raw_response.create(
        model="fake-llm",
        max_tokens=64,
        system=[{"type": "text", "text": "You are terse."}],
        stop_sequences=["END"],
        extra_headers={"x-api-key": "sk-ant-key"},
        metadata={"user_id": "u-1"},
        tools=[{"name": "lookup", "description": "Look up.", "input_schema": {"type": "object"}}],
        messages=[
            {"role": "user", "content": "Earlier question <document>Old context. It stays.</document>"},
            {"role": "assistant", "content": "Earlier answer."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": question_with_blocks()},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                    {
                        "type": "document",
                        "title": plain["title"],
                        "source": {"type": "text", "media_type": "text/plain", "data": plain["text"]},
                    },
                ],
            },
        ],
    )
    message = raw.parse()
    assert message.content[0].text == "ok"
    assert_optimized(raw.headers)
    rec = up.last(MESSAGES)
    text, data = ("messages", 2, "content", 0, "text"), ("messages", 2, "content", 2, "source", "data")
    assert_only_context_changed(sent[-1], rec.body, [text, data])
    assert value(rec.body, text).endswith(f"\n\nQuestion: {QUESTION}")
    # the client's credentials and API version, as sent (this SDK sends its key as a bearer token)
    assert rec.header("authorization") == "Bearer sk-ant-client" and rec.header("x-api-key") == "sk-ant-key"
    assert rec.header("anthropic-version") == claude.default_headers["anthropic-version"]


@pytest.mark.model
def test_messages_stream_relays_events_as_they_arrive_and_compresses_a_large_tool_result(claude, sent, up):
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "x"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": TOOL_OUTPUT}]}
    stream = claude.messages.create(
        model="gated",
        max_tokens=64,
        stream=True,
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [tool_use]},
            {"role": "user", "content": [result]},
        ],
    )
    events = iter(stream)
    kinds = []
    for event in events:  # up to the first text delta: the upstream is still holding the rest back
        kinds.append(event.type)
        if event.type == "content_block_delta":
            assert event.delta.text == "Hel"
            break
    assert kinds == ["message_start", "content_block_start", "content_block_delta"]
    assert up.gate_released is None
    up.gate.set()
    rest = list(events)
    assert up.gate_released is True
    assert [e.type for e in rest][-1] == "message_stop"
    assert "".join(e.delta.text for e in rest if e.type == "content_block_delta") == "lo"
    assert_optimized(stream.response.headers)
    assert_only_context_changed(sent[-1], up.last(MESSAGES).body, [("messages", 2, "content", 0, "content", 0, "text")])


def test_messages_upstream_errors_reach_the_sdk_as_its_error_types(claude, up):
    with pytest.raises(anthropic.BadRequestError, match="bad thing") as exc:
        claude.messages.create(model="error-400", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad thing"}}
    with pytest.raises(anthropic.InternalServerError, match="upstream broke"):
        claude.messages.create(model="error-500", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


def test_messages_own_errors_come_in_anthropics_shape_and_are_not_forwarded(claude, proxy, up):
    n = len(up.requests)
    with pytest.raises(anthropic.BadRequestError, match="ratio must be in") as exc:
        claude.messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], extra_headers={"x-ragopt-ratio": "7"}
        )
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{proxy}{MESSAGES}", content=b'{"model": "m", "messages": [', timeout=None)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{proxy}{MESSAGES}", json={"model": "m", "messages": [], "system": 5}, timeout=None)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("system must be")
    r = httpx.get(f"{proxy}{MESSAGES}", timeout=None)
    assert r.status_code == 405 and r.json()["type"] == "error" and r.headers["allow"] == "POST"
    assert len(up.requests) == n


# -- OpenAI Responses API -------------------------------------------------------------------------------------
@pytest.mark.model
def test_responses_compress_input_text_and_function_output_and_forward_the_rest_byte_for_byte(gpt, proxy, sent, up):
    n = parse_metrics(httpx.get(f"{proxy}/metrics").text).get('ragopt_requests_total{route="responses"}', 0.0)
    call = {"type": "function_call", "call_id": "call_1", "name": "search", "arguments": '{"q": "x"}'}
    raw = gpt.responses.with_raw_response.create(
        model="fake-llm",
        instructions="You are terse.",
        temperature=0.25,
        metadata={"k": "v"},
        input=[
            {"role": "user", "content": "Earlier question <document>Old context. It stays.</document>"},
            {"role": "assistant", "content": "Earlier answer."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question_with_blocks()}]},
            call,
            {"type": "function_call_output", "call_id": "call_1", "output": TOOL_OUTPUT},
        ],
    )
    assert raw.parse().output_text == "ok"
    assert_optimized(raw.headers)
    rec = up.last(RESPONSES)
    paths: list[JsonPath] = [("input", 2, "content", 0, "text"), ("input", 4, "output")]
    assert_only_context_changed(sent[-1], rec.body, paths)
    assert rec.header("authorization") == "Bearer sk-client"
    m = parse_metrics(httpx.get(f"{proxy}/metrics").text)
    assert m['ragopt_requests_total{route="responses"}'] == n + 1


@pytest.mark.model
def test_responses_stream_relays_events_as_they_arrive_and_compresses_a_string_input(gpt, sent, up):
    stream = gpt.responses.create(model="gated", input=question_with_blocks(), stream=True)
    events = iter(stream)
    first = [next(events), next(events)]  # the upstream is still holding the rest back
    assert [e.type for e in first] == ["response.created", "response.output_text.delta"] and first[1].delta == "Hel"
    assert up.gate_released is None
    up.gate.set()
    rest = list(events)
    assert up.gate_released is True
    assert [e.type for e in rest] == ["response.output_text.delta", "response.completed"]
    assert rest[-1].response.output_text == "Hello"
    assert_optimized(stream.response.headers)
    assert_only_context_changed(sent[-1], up.last(RESPONSES).body, [("input",)])


def test_responses_without_documents_are_forwarded_byte_for_byte(gpt, sent, up):
    raw = gpt.responses.with_raw_response.create(model="fake-llm", input="Just a question, no documents.")
    assert raw.headers["x-ragopt-status"] == "no_context" and raw.parse().output_text == "ok"
    assert up.last(RESPONSES).body == sent[-1]


def test_responses_upstream_errors_reach_the_sdk_as_its_error_types(gpt, up):
    with pytest.raises(openai.BadRequestError, match="bad thing") as exc:
        gpt.responses.create(model="error-400", input="hi")
    assert exc.value.code == "bad"
    with pytest.raises(openai.InternalServerError, match="upstream broke"):
        gpt.responses.create(model="error-500", input="hi", stream=True)


def test_responses_own_errors_come_in_openais_shape_and_are_not_forwarded(gpt, proxy, up):
    n = len(up.requests)
    with pytest.raises(openai.BadRequestError, match="input must be a string or an array") as exc:
        gpt.responses.create(model="m", input=5)  # type: ignore[arg-type]
    assert exc.value.param == "input"
    r = httpx.post(f"{proxy}{RESPONSES}", content=b"[1, 2]", timeout=None)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    bad_part = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}
    r = httpx.post(f"{proxy}{RESPONSES}", json=bad_part, timeout=None)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].text"
    assert len(up.requests) == n


# -- shared with chat completions: the engine, per-request language, /stats ------------------------------------
@pytest.mark.model
def test_messages_and_responses_take_the_request_language_and_count_their_model_in_stats(upstream, up):
    from rag_opt import ContextOptimizer

    recording = Recording(ContextOptimizer())
    with serve_proxy(upstream.url, recording) as (url, state):  # type: ignore[attr-defined]
        assert set(state.metrics.stats()["requests"]["by_route"]) >= {"messages", "responses"}  # from the start
        r = httpx.post(
            f"{url}{MESSAGES}",
            headers={"x-ragopt-language": "DE"},
            json={
                "model": "claude-x",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": question_with_blocks()}],
            },
            timeout=None,
        )
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "optimized"
        assert recording.calls[-1]["language"] == "de"
        r = httpx.post(
            f"{url}{RESPONSES}",
            json={"model": "gpt-x", "input": question_with_blocks(), "rag_opt": {"language": "pt_BR"}},
            timeout=None,
        )
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "optimized"
        assert recording.calls[-1]["language"] == "pt-br"
        assert b"rag_opt" not in up.last(RESPONSES).body
        r = httpx.post(
            f"{url}{MESSAGES}",
            headers={"x-ragopt-language": "klingon!"},
            json={"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            timeout=None,
        )
        assert r.status_code == 400 and r.json()["type"] == "error" and "ISO 639" in r.json()["error"]["message"]
        n = len(recording.calls)
        httpx.post(f"{url}{RESPONSES}", json={"model": "gpt-x", "input": question_with_blocks()}, timeout=None)
        assert len(recording.calls) == n + 1 and "language" not in recording.calls[-1]  # the optimizer's own
        stats = httpx.get(f"{url}/stats").json()
    assert stats["requests"]["by_route"]["messages"] == 2 and stats["requests"]["by_route"]["responses"] == 2
    assert stats["models"]["claude-x"]["optimizations"] == 1 and stats["models"]["gpt-x"]["optimizations"] == 2
    assert stats["models"]["claude-x"]["tokens_saved"] > 0
    assert stats["requests"]["chat_completions"]["optimized"] == 3
    assert stats["requests"]["chat_completions"]["rejected"] == 1


def test_an_overload_refused_on_the_messages_route_is_a_429_in_anthropics_shape():
    from rag_opt.server.engine import overloaded_response
    from rag_opt.server.errors import Overloaded

    r = overloaded_response(Overloaded("queue_full", 2.5), 10_000, "anthropic")
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert json.loads(bytes(r.body)) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": json.loads(bytes(r.body))["error"]["message"]},
    }
    assert json.loads(bytes(overloaded_response(Overloaded("queue_full"), 10_000).body))["error"]["code"] == (
        "ragopt_overloaded"
    )
