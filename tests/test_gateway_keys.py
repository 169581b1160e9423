"""The proxy key as a gateway's Headroom guardrail sends it: ``X-Headroom-Proxy-Token`` (the header Headroom's
proxy reads ``HEADROOM_PROXY_TOKEN`` from besides ``Authorization: Bearer``) is accepted as the proxy key, with the
treatment of ``X-RagOpt-Api-Key``: compared in constant time, refused when sent twice or when it disagrees with
``X-RagOpt-Api-Key``, redacted in ``--log-bodies`` and never forwarded upstream.

Runnable alone: ``python -m pytest tests/test_gateway_keys.py``. uvicorn on 127.0.0.1 runs the proxy (with the
serving options of ``rag-opt serve``) in front of a recording upstream (tests/upstream_server.py); optimizations
use rag-opt's real pipeline with the BM25 scorer. Every wait is bounded; nothing depends on the machine's speed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rag_opt.server import redaction, security
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, blocks
from tests.upstream_server import FakeUpstream, ServerThread, bm25_optimizer, serve_proxy

PROXY_KEY = "rk-gateway-keys-proxy-Tz84"
OTHER_TOKEN = "headroom-token-not-ours-5521"  # a Headroom token: not rag-opt's key
CLIENT_KEY = "sk-client-provider-key-9931"
HEADROOM = "X-Headroom-Proxy-Token"
WAIT_S = 60.0  # the most any answer is waited for: a bound, never a speed budget
CHAT, COMPRESS = "/v1/chat/completions", "/v1/compress"
# Headroom's messages contract, as a gateway's guardrail sends it
MESSAGES_BODY = {
    "model": "gpt-4o",
    "messages": [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": f"{blocks(EXAMPLE_DOCS)}\n\n{EXAMPLE_QUESTION}"},
    ],
}
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


@pytest.fixture(scope="module")
def keyed(upstream: tuple[FakeUpstream, str]) -> Iterator[str]:
    with serve_proxy(upstream[1], bm25_optimizer(), api_key=PROXY_KEY) as (url, _):
        yield url


def _post(url: str, path: str, body: dict[str, Any], headers: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=WAIT_S)


# -- accepted with the right key ---------------------------------------------------------------------------------
def test_the_headroom_token_header_carries_the_proxy_key(keyed):
    r = _post(keyed, COMPRESS, MESSAGES_BODY, {HEADROOM: PROXY_KEY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["messages"]) == 2 and out["messages"][0] == MESSAGES_BODY["messages"][0]
    assert {"tokens_before", "tokens_after", "compression_ratio", "stats"} <= set(out)
    assert out["stats"]["status"] in ("optimized", "unchanged")
    assert _post(keyed, CHAT, CHAT_BODY, {HEADROOM.lower(): PROXY_KEY}).status_code == 200  # any case of the name


def test_kong_sends_the_token_as_bearer_and_as_the_headroom_header(keyed, upstream):
    headers = {"Authorization": f"Bearer {PROXY_KEY}", HEADROOM: PROXY_KEY}
    assert _post(keyed, COMPRESS, MESSAGES_BODY, headers).status_code == 200
    assert _post(keyed, CHAT, CHAT_BODY, headers).status_code == 200
    rec = upstream[0].last()
    assert rec.header("authorization") is None and rec.header("x-headroom-proxy-token") is None


def test_the_client_key_in_authorization_travels_beside_the_headroom_token(keyed, upstream):
    """As with X-RagOpt-Api-Key: a Bearer that is not the proxy key is the client's own, forwarded as it came."""
    r = _post(keyed, CHAT, CHAT_BODY, {"Authorization": f"Bearer {CLIENT_KEY}", HEADROOM: PROXY_KEY})
    assert r.status_code == 200
    rec = upstream[0].last()
    assert rec.header("authorization") == f"Bearer {CLIENT_KEY}" and rec.header("x-headroom-proxy-token") is None


# -- refused with a wrong key ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "headers",
    [
        {HEADROOM: OTHER_TOKEN},
        {HEADROOM: f"Bearer {PROXY_KEY}"},  # the header holds the token itself, no scheme
        {HEADROOM: PROXY_KEY[:-1]},
        {HEADROOM: ""},
        {HEADROOM: OTHER_TOKEN, "X-RagOpt-Api-Key": PROXY_KEY},  # the two headers of the key alone disagree
        {HEADROOM: PROXY_KEY, "X-RagOpt-Api-Key": OTHER_TOKEN},
        {HEADROOM: OTHER_TOKEN, "X-RagOpt-Api-Key": PROXY_KEY, "Authorization": f"Bearer {PROXY_KEY}"},
    ],
    ids=["other-token", "with-scheme", "prefix", "empty", "wrong-vs-ragopt", "ragopt-wrong", "even-with-bearer"],
)
def test_a_wrong_headroom_token_is_a_401_and_is_not_forwarded(keyed, upstream, headers):
    fake = upstream[0]
    n = len(fake.requests)
    for path, body in ((COMPRESS, MESSAGES_BODY), (CHAT, CHAT_BODY)):
        r = _post(keyed, path, body, headers)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and "X-Headroom-Proxy-Token" in err["message"]
        assert PROXY_KEY not in r.text and OTHER_TOKEN not in r.text
    assert len(fake.requests) == n


def test_the_headroom_token_is_compared_in_constant_time(keyed, monkeypatch):
    seen: list[tuple[bytes, bytes]] = []
    real = security.hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    assert _post(keyed, COMPRESS, MESSAGES_BODY, {HEADROOM: OTHER_TOKEN}).status_code == 401
    assert (OTHER_TOKEN.encode(), PROXY_KEY.encode()) in seen


def test_the_two_headers_of_the_key_alone_agreeing_are_served(keyed):
    headers = {HEADROOM: PROXY_KEY, "X-RagOpt-Api-Key": PROXY_KEY}
    assert _post(keyed, COMPRESS, MESSAGES_BODY, headers).status_code == 200


# -- refused when sent twice -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "values",
    [(OTHER_TOKEN, PROXY_KEY), (PROXY_KEY, OTHER_TOKEN), (PROXY_KEY, PROXY_KEY)],
    ids=["wrong-then-right", "right-then-wrong", "same-twice"],
)
def test_a_repeated_headroom_token_is_a_400_and_never_forwarded(keyed, upstream, values):
    fake = upstream[0]
    n = len(fake.requests)
    headers = [(HEADROOM, v) for v in values]
    for path, body in ((COMPRESS, MESSAGES_BODY), (CHAT, CHAT_BODY)):
        r = _post(keyed, path, body, headers)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "duplicate_header" and "x-headroom-proxy-token" in err["message"]
    assert len(fake.requests) == n
    assert _post(keyed, COMPRESS, MESSAGES_BODY, [(HEADROOM, PROXY_KEY)]).status_code == 200  # once is served


def test_a_repeated_headroom_token_is_a_400_without_a_proxy_key(upstream):
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        headers = [(HEADROOM, "token-a"), (HEADROOM, "token-b")]
        assert _post(url, COMPRESS, MESSAGES_BODY, headers).status_code == 400
        assert _post(url, COMPRESS, MESSAGES_BODY, headers[:1]).status_code == 200


# -- stripped from the upstream request --------------------------------------------------------------------------
def test_the_headroom_token_never_reaches_the_upstream(keyed, upstream):
    fake = upstream[0]
    headers = {HEADROOM: PROXY_KEY, "X-Unrelated": "keep-me"}
    r = httpx.post(f"{keyed}{CHAT}", json=CHAT_BODY, headers=headers, timeout=WAIT_S)
    assert r.status_code == 200
    rec = fake.last()
    assert rec.header("x-headroom-proxy-token") is None and rec.header("x-unrelated") == "keep-me"
    assert PROXY_KEY not in json.dumps(rec.headers) and PROXY_KEY not in rec.body.decode()
    assert rec.header("authorization") is None  # no upstream key configured: no Authorization at all
    assert httpx.get(f"{keyed}/v1/models", headers=headers, timeout=WAIT_S).status_code == 200
    assert fake.last("/v1/models").header("x-headroom-proxy-token") is None


def test_the_headroom_token_is_removed_without_a_proxy_key_too(upstream):
    """Like X-RagOpt-Api-Key, it is a compressor's credential, never a provider's: always removed."""
    fake = upstream[0]
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        r = _post(url, CHAT, CHAT_BODY, {HEADROOM: OTHER_TOKEN, "Authorization": f"Bearer {CLIENT_KEY}"})
        assert r.status_code == 200
    rec = fake.last()
    assert rec.header("x-headroom-proxy-token") is None and OTHER_TOKEN not in json.dumps(rec.headers)
    assert rec.header("authorization") == f"Bearer {CLIENT_KEY}"


# -- redacted in the logs ----------------------------------------------------------------------------------------
def test_redact_headers_blanks_the_headroom_token():
    line = redaction.redact_headers([(b"X-Headroom-Proxy-Token", OTHER_TOKEN.encode()), (b"x-trace", b"t-1")])
    assert line == "x-headroom-proxy-token: [redacted]; x-trace: t-1"
    assert "x-headroom-proxy-token" in redaction.SENSITIVE_HEADERS


@pytest.mark.parametrize("api_key", [PROXY_KEY, None], ids=["keyed", "open"])
def test_log_bodies_never_logs_the_headroom_token(upstream, caplog, api_key):
    caplog.set_level(logging.DEBUG)
    token = PROXY_KEY if api_key else OTHER_TOKEN
    body: dict[str, Any] = {**MESSAGES_BODY, "config": {"proxy_token": token}}  # a member named like a credential
    if api_key:  # the configured key is redacted anywhere, in free text too
        body["note"] = f"the key {token} pasted in a field"
    with serve_proxy(upstream[1], bm25_optimizer(), api_key=api_key, log_bodies=True) as (url, _):
        assert _post(url, COMPRESS, body, {HEADROOM: token, "X-Trace": "visible-trace-id"}).status_code == 200
        assert _post(url, CHAT, CHAT_BODY, {HEADROOM: token}).status_code == 200
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "visible-trace-id" in logged and "request POST /v1/compress" in logged  # the bodies were logged ...
    assert token not in logged  # ... without the token, from the header or the body
    if api_key:
        assert "[redacted]" in logged


# -- the names other modules import from rag_opt.server.security --------------------------------------------------
def test_the_redaction_names_are_still_importable_from_security():
    for name in redaction.__all__:
        assert getattr(security, name) is getattr(redaction, name), name
        assert name in security.__all__
    assert security.HEADROOM_KEY_HEADER in security.SINGLE_HEADERS and security.KEY_HEADER in security.SINGLE_HEADERS
