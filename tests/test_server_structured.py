"""Structured tool results through the proxy, end to end (issue 21, defect 1): a tool result that is one JSON value
or one table is compressed at its own grain (records, rows), never emptied. uvicorn on 127.0.0.1, a recording
upstream (tests/upstream_server.py) and the real embedded proxy model."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import CSV_HEADER, CSV_ROWS, RECORDS, RECORDS_CSV, RECORDS_JSON
from tests.upstream_server import FakeUpstream, ServerThread, serve_proxy

pytestmark = pytest.mark.model

QUESTION = "How much does item 42 cost?"


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        fake.url = server.url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture(scope="module")
def proxy(upstream: FakeUpstream) -> Iterator[str]:
    from rag_opt import ContextOptimizer

    with serve_proxy(upstream.url, ContextOptimizer()) as (url, _):  # type: ignore[attr-defined]
        yield url


def post(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    r = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=None)
    assert r.status_code == 200, r.text
    return r


def assert_records_kept(text: str, *, at_most: int) -> list[dict[str, Any]]:
    """``text`` is valid JSON: a list of some of the records, unchanged and in order, record 42 among them."""
    kept = json.loads(text)
    assert isinstance(kept, list) and 0 < len(kept) <= at_most
    assert all(r in RECORDS for r in kept) and kept == sorted(kept, key=lambda r: r["id"])
    assert RECORDS[41] in kept and RECORDS[41]["id"] == 42
    return kept


def test_a_json_tool_message_keeps_the_records_asked_about_as_valid_json(proxy: str, upstream: FakeUpstream) -> None:
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "items"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": RECORDS_JSON},
    ]
    r = post(proxy, "/v1/chat/completions", {"model": "m", "messages": messages})  # the default budget: half
    assert r.headers["x-ragopt-status"] == "optimized"
    assert 0 < int(r.headers["x-ragopt-tokens-after"]) < int(r.headers["x-ragopt-tokens-before"])
    assert "x-ragopt-over-budget" not in r.headers
    got = upstream.last().json()["messages"]
    assert got[:2] == messages[:2] and got[2]["tool_call_id"] == "c1"
    assert_records_kept(got[2]["content"], at_most=40)


def test_a_csv_tool_result_keeps_its_header_and_whole_rows(proxy: str, upstream: FakeUpstream) -> None:
    tool_use = {"type": "tool_use", "id": "t1", "name": "items", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": RECORDS_CSV}
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [tool_use]},
        {"role": "user", "content": [result]},
    ]
    body = {"model": "m", "max_tokens": 16, "messages": messages}
    r = post(proxy, "/v1/messages", body, **{"x-ragopt-ratio": "0.9"})
    assert r.headers["x-ragopt-status"] == "optimized"
    assert 0 < int(r.headers["x-ragopt-tokens-after"]) < int(r.headers["x-ragopt-tokens-before"])
    text = upstream.last("/v1/messages").json()["messages"][2]["content"][0]["content"]
    lines = text.splitlines()
    assert lines[0] == CSV_HEADER and 1 < len(lines) - 1 < len(CSV_ROWS)
    assert all(row in CSV_ROWS for row in lines[1:]) and lines[1:] == sorted(lines[1:], key=CSV_ROWS.index)
    assert CSV_ROWS[41] in lines and CSV_ROWS[41].startswith("42,item 42,")
    assert all(len(row) == 5 for row in csv.reader(io.StringIO(text)))


def test_a_budget_smaller_than_one_record_keeps_that_record_whole_and_says_so(
    proxy: str, upstream: FakeUpstream
) -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "function_call", "call_id": "c1", "name": "items", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": RECORDS_JSON},
    ]
    r = post(proxy, "/v1/responses", {"model": "m", "input": items}, **{"x-ragopt-target-tokens": "10"})
    assert r.headers["x-ragopt-status"] == "optimized"
    after, over = int(r.headers["x-ragopt-tokens-after"]), int(r.headers["x-ragopt-over-budget"])
    assert after == 10 + over and over > 0  # one record (~45 tokens) kept whole, over the budget of 10
    assert_records_kept(upstream.last("/v1/responses").json()["input"][2]["output"], at_most=1)


def test_compress_keeps_a_json_document_valid_at_a_light_budget(proxy: str) -> None:
    body = {"question": QUESTION, "documents": [RECORDS_JSON], "budget": {"ratio": 0.9}}
    out = post(proxy, "/v1/compress", body).json()
    assert out["status"] == "optimized" and len(out["documents"]) == 1
    assert 0 < out["tokens_after"] <= out["token_budget"]
    assert_records_kept(out["documents"][0]["text"], at_most=59)
