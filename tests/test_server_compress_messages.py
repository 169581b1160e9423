"""``POST /v1/compress`` with a messages body (Headroom's contract, which Kong, LiteLLM's headroom guardrail,
Portkey and Superwise call), on the real app (httpx's ASGI transport) with the real embedded proxy model over
held-out HotpotQA paragraphs: the context found as the proxy finds it, every other message returned as sent, the
nothing-to-do answers, the 400s, the schema and the metrics of both contracts."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rag_opt.server.app import create_app
from rag_opt.server.settings import ProxySettings
from rag_opt.wire.compress import compress_schema
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, RECORDS, RECORDS_JSON, assert_verbatim, blocks, hotpot_dev
from tests.upstream_server import parse_metrics

pytestmark = pytest.mark.anyio
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "docs" / "compress.schema.json"
UNLIMITED_MS = 86_400_000.0
RECORDS_QUESTION = "How much does item 42 cost?"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def optimizer() -> Any:
    from rag_opt import ContextOptimizer

    return ContextOptimizer()


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


@pytest.fixture(scope="module")
def held_out() -> tuple[str, str]:
    """A held-out (dev) HotpotQA question and its 10 paragraphs as one search tool's result."""
    ex = hotpot_dev(1)[0]
    assert len(ex["context"]) == 10
    return ex["question"], "\n\n".join(f"{title}\n{''.join(sents)}" for title, sents in ex["context"])


def rag_conversation(question: str, paragraphs: str) -> list[dict[str, Any]]:
    """A multi-turn RAG conversation (OpenAI): a search for the first question, its answer, a follow-up."""
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}
    return [
        {"role": "system", "content": "Answer from the search results."},
        {"role": "user", "content": [{"type": "text", "text": question}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": paragraphs},
        {"role": "assistant", "content": "From the results: see above."},
        {"role": "user", "content": "Thanks. Which of them is older?"},
    ]


async def compress(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    r = await client.post("/v1/compress", json=body, headers=headers)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


# -- the context is compressed, everything else comes back as sent -------------------------------------------
@pytest.mark.model
@pytest.mark.data
async def test_an_earlier_tool_result_is_compressed_and_every_other_message_is_unchanged(
    client: httpx.AsyncClient, held_out: tuple[str, str]
) -> None:
    question, paragraphs = held_out
    messages = rag_conversation(question, paragraphs)
    sent = copy.deepcopy(messages)
    out = await compress(client, {"messages": messages, "model": "gpt-4o", "config": {"compress_user_messages": 1}})
    got = out["messages"]
    assert len(got) == len(sent) and [m["role"] for m in got] == [m["role"] for m in sent]
    assert [m for i, m in enumerate(got) if i != 3] == [m for i, m in enumerate(sent) if i != 3]
    assert {k: v for k, v in got[3].items() if k != "content"} == {"role": "tool", "tool_call_id": "call_1"}
    tool = got[3]["content"]
    assert isinstance(tool, str) and len(tool) <= 0.8 * len(paragraphs)
    assert_verbatim(tool.strip(), paragraphs)
    assert got[1]["content"] == [{"type": "text", "text": question}]  # the question, and its shape, untouched
    # token counts at the top level (LiteLLM reads them), the rest in stats
    assert 0 < out["tokens_after"] < out["tokens_before"]
    assert out["tokens_saved"] == out["tokens_before"] - out["tokens_after"]
    assert out["compression_ratio"] == pytest.approx(out["tokens_after"] / out["tokens_before"])
    stats = out["stats"]
    assert (stats["engine"], stats["status"], stats["tier"], stats["reason"]) == ("rag-opt", "optimized", "model", None)
    assert stats["messages_changed"] == [3] and stats["target_tokenizer"] == "o200k_base"
    (context,) = stats["contexts"]
    assert context["messages"] == [3] and context["question_from"] == "user" and context["documents"] == 1
    assert (context["tokens_before"], context["tokens_after"]) == (out["tokens_before"], out["tokens_after"])
    assert context["timings"]["score_ms"] > 0 and stats["total_ms"] > 0
    assert stats["ignored"] == ["config.compress_user_messages"]  # a gateway's Headroom setting: not refused


@pytest.mark.model
@pytest.mark.data
async def test_anthropic_blocks_each_turn_read_by_its_own_question(
    client: httpx.AsyncClient, held_out: tuple[str, str]
) -> None:
    """Anthropic content: a tool_result (its text blocks, cache_control kept) read by the first question, and
    <document> blocks in a later user message read by that message's own question."""
    question, paragraphs = held_out
    docs = EXAMPLE_DOCS[:4]
    result = {
        "type": "tool_result",
        "tool_use_id": "tu_1",
        "content": [{"type": "text", "text": paragraphs}],
        "cache_control": {"type": "ephemeral"},
    }
    messages = [
        {"role": "user", "content": [{"type": "text", "text": question}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "search", "input": {"q": "x"}}]},
        {"role": "user", "content": [result]},
        {"role": "assistant", "content": [{"type": "text", "text": "Noted."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": blocks(docs)}, {"type": "text", "text": EXAMPLE_QUESTION}],
        },
    ]
    sent = copy.deepcopy(messages)
    out = await compress(client, {"messages": messages})
    got = out["messages"]
    assert len(got) == 5 and [got[i] for i in (0, 1, 3)] == [sent[i] for i in (0, 1, 3)]
    block = got[2]["content"][0]
    assert len(got[2]["content"]) == 1 and {k: v for k, v in block.items() if k != "content"} == {
        k: v for k, v in result.items() if k != "content"
    }
    assert [p["type"] for p in block["content"]] == ["text"]  # a list of text blocks stays one
    assert len(block["content"][0]["text"]) <= 0.8 * len(paragraphs)
    assert_verbatim(block["content"][0]["text"].strip(), paragraphs)
    last = got[4]["content"]
    assert last[1] == sent[4]["content"][1] and len(last[0]["text"]) < len(sent[4]["content"][0]["text"])
    assert out["stats"]["status"] == "optimized" and out["stats"]["messages_changed"] == [2, 4]
    assert [c["messages"] for c in out["stats"]["contexts"]] == [[2], [4]]
    assert [c["documents"] for c in out["stats"]["contexts"]] == [1, len(docs)]


@pytest.mark.model
async def test_a_tool_calls_arguments_serve_when_no_user_message_is_sent(client: httpx.AsyncClient) -> None:
    """A gateway sent only the tool exchange: the call's arguments are the question; a JSON tool result is
    compressed at its records' grain and stays valid JSON."""
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "items", "arguments": json.dumps({"q": RECORDS_QUESTION})},
    }
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": RECORDS_JSON},
    ]
    out = await compress(client, {"messages": messages})
    assert out["messages"][0] == messages[0] and out["stats"]["contexts"][0]["question_from"] == "tool_call"
    kept = json.loads(out["messages"][1]["content"])
    assert 0 < len(kept) < len(RECORDS) and all(r in RECORDS for r in kept) and RECORDS[41] in kept
    assert 0 < out["tokens_after"] < out["tokens_before"]


# -- nothing to do: the messages come back as sent, the reason in stats ----------------------------------------
@pytest.mark.model
@pytest.mark.data
async def test_without_context_or_question_the_messages_come_back_unchanged(
    client: httpx.AsyncClient, held_out: tuple[str, str]
) -> None:
    question, paragraphs = held_out
    conversation = rag_conversation(question, paragraphs)
    cases = [
        ("no_context", [conversation[0], {"role": "user", "content": question}], {}),
        ("no_query", [conversation[3], conversation[4]], {}),  # a tool result, no question and no call before it
        ("disabled", conversation, {"x-ragopt-disable": "true"}),
        ("disabled", conversation, {"x-headroom-bypass": "true"}),  # Headroom's clients' switch
        ("no_context", [], {}),
    ]
    for status, messages, headers in cases:
        out = await compress(client, {"messages": messages, "model": "m"}, **headers)
        assert out["messages"] == messages, status
        assert out["stats"]["status"] == status and out["stats"]["reason"], out["stats"]
        assert (out["tokens_before"], out["tokens_after"], out["compression_ratio"]) == (0, 0, 1.0)
        assert out["stats"]["messages_changed"] == [] and out["stats"]["contexts"] == []


@pytest.mark.model
@pytest.mark.data
async def test_a_context_the_optimizer_cannot_take_fails_open_with_the_messages_as_sent(
    make_client: Any, optimizer: Any, held_out: tuple[str, str]
) -> None:
    messages = rag_conversation(*held_out)
    async with make_client(optimizer, max_units=2) as c:  # the tool result has more units than that
        out = await compress(c, {"messages": messages})
        assert out["messages"] == messages and out["stats"]["status"] == "fail_open"
        assert out["stats"]["reason"] == "limit" and out["stats"]["contexts"][0]["status"] == "fail_open"
        m = parse_metrics((await c.get("/metrics")).text)
    assert m['ragopt_compress_requests_total{outcome="fail_open"}'] == 1
    assert m['ragopt_fail_open_total{reason="limit"}'] == 1


# -- a malformed body is a 400 naming the problem ------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        ({"messages": {"role": "user"}}, "messages", "must be an array"),
        ({"messages": ["hi"]}, "messages[0]", "must be an object"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string"),
        ({"messages": [], "model": 5}, "model", "valid string"),
        ({"messages": [], "config": []}, "config", "valid dictionary"),
        ({"messages": [], "config": {"ratio": 2}}, "config.ratio", "less than or equal"),
        ({"messages": [], "config": {"ratio": 0.5, "threshold": 0.5}}, "config", "one"),
        ({"messages": [], "config": {"ordering": "sideways"}}, "config.ordering", "'lost_in_the_middle'"),
        ({"messages": [], "config": {"target": "hf:someone/tokenizer"}}, "config.target", "this server allows"),
        ({"messages": [], "question": "q?"}, "question", "not both"),
    ],
)
async def test_a_malformed_messages_body_is_a_400_naming_the_problem(
    client: httpx.AsyncClient, payload: dict[str, Any], param: str, words: str
) -> None:
    r = await client.post("/v1/compress", json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"], err


async def test_a_duplicate_key_in_a_message_is_a_400(client: httpx.AsyncClient) -> None:
    raw = b'{"messages": [{"role": "user", "content": "a", "content": "b"}]}'
    r = await client.post("/v1/compress", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_key", r.text


# -- the schema and the metrics ----------------------------------------------------------------------------------
async def test_the_schema_holds_both_contracts_committed_and_served(client: httpx.AsyncClient) -> None:
    committed = json.loads(SCHEMA_FILE.read_text())
    assert committed == compress_schema(), "regenerate it: python -m rag_opt.wire.compress > docs/compress.schema.json"
    assert committed["messages_request"]["required"] == ["messages"]
    assert {"messages", "tokens_before", "tokens_after", "compression_ratio", "stats"} <= set(
        committed["messages_response"]["required"]
    )
    assert (await client.get("/v1/compress/schema")).json() == committed


@pytest.mark.model
@pytest.mark.data
async def test_metrics_count_both_contracts_as_the_chat_routes_do(
    client: httpx.AsyncClient, held_out: tuple[str, str]
) -> None:
    """Requests, outcomes, tokens before and after (saved) and latency: one optimization per contract."""
    question, paragraphs = held_out
    docs = await compress(client, {"question": EXAMPLE_QUESTION, "documents": EXAMPLE_DOCS[:4], "target": "gpt-4o"})
    msgs = await compress(client, {"messages": rag_conversation(question, paragraphs), "model": "gpt-4o"})
    await compress(client, {"messages": [{"role": "user", "content": question}]})  # no context
    r = await client.post("/v1/compress", json={"messages": "hi"})
    assert r.status_code == 400
    m = parse_metrics((await client.get("/metrics")).text)
    assert m['ragopt_requests_total{route="compress"}'] == 4
    outcomes = {
        o: m[f'ragopt_compress_requests_total{{outcome="{o}"}}'] for o in ("optimized", "no_context", "rejected")
    }
    assert outcomes == {"optimized": 2, "no_context": 1, "rejected": 1}
    assert m['ragopt_local_errors_total{kind="invalid_request"}'] == 1
    assert m['ragopt_optimizations_total{tier="model"}'] == 2 and m["ragopt_optimizer_latency_seconds_count"] == 2
    before, after = docs["tokens_before"] + msgs["tokens_before"], docs["tokens_after"] + msgs["tokens_after"]
    assert (m["ragopt_tokens_before_total"], m["ragopt_tokens_after_total"]) == (before, after)
    stats = (await client.get("/stats")).json()
    assert stats["tokens"] == {"before": before, "after": after, "saved": before - after}
    assert stats["models"]["gpt-4o"]["optimizations"] == 2  # the documents' target, the messages' model
    assert stats["requests"]["by_outcome"]["no_context"] == 1
