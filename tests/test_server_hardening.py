"""The risks of the second adversarial review (issue 21), attacked as a web page, a faulty client or an outsider
would: every test is named after what it attacks.

Runnable alone: ``python -m pytest tests/test_server_hardening.py``. uvicorn on 127.0.0.1 runs the proxy (with the
serving options of ``rag-opt serve``) and a recording upstream (tests/upstream_server.py); raw sockets send what
an HTTP client library would refuse to. Optimizations use rag-opt's real pipeline with the BM25 scorer (which text
is context is what matters here, not how it is scored); the Anthropic block rules are checked on the rewrite
itself, with the optimizer's decision given. Every wait is bounded; nothing depends on the machine's speed.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from rag_opt.errors import ConfigurationError
from rag_opt.server.browser import HostPolicy, host_name
from rag_opt.server.paths import JSON_PATHS, LOCAL_PATHS
from rag_opt.server.settings import ProxySettings
from rag_opt.server.settings_checks import MIN_PROXY_KEY_CHARS
from rag_opt.types import OptimizeResult, OutputDocument
from rag_opt.wire.anthropic_messages import PLACEHOLDER, plan_messages
from rag_opt.wire.markup import code_spans, scan
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION
from tests.upstream_server import (
    FakeUpstream,
    ServerThread,
    bm25_optimizer,
    parse_metrics,
    serve_proxy,
    upstream_pool_is_clean,
)

PROXY_KEY = "rk-hardening-proxy-Kx41"
UPSTREAM_KEY = "sk-operator-hardening-77"
CLIENT_KEY = "sk-client-hardening-55"
WAIT_S = 60.0  # the most any condition below is waited for: a bound, never a speed budget
CHAT, MESSAGES, RESPONSES, COMPRESS = "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/compress"


# -- helpers ---------------------------------------------------------------------------------------------------
def wait_until(cond: Any, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def raw_request(
    url: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, host: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """Send one request on a fresh socket (``host``: the Host header, default the proxy's address); the status,
    headers and body of the answer."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host if host is not None else f'127.0.0.1:{_port(url)}'}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines += [f"Content-Length: {len(body)}", "Connection: close"]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + body
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=WAIT_S) as sock:
        sock.sendall(data)
        buf = b""
        while chunk := sock.recv(65536):
            buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    got = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split()[1]), got, rest


def error_code(body: bytes) -> str | None:
    return json.loads(body)["error"].get("code")


def chat(content: str, **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra}).encode()


def blocks(docs: list[dict[str, Any]]) -> str:
    return "\n".join(f'<document id="{d["id"]}">{d["text"]}</document>' for d in docs)


CONTEXT = chat(f"{blocks(EXAMPLE_DOCS[:3])}\n\n{EXAMPLE_QUESTION}", rag_opt={"ratio": 0.4})
BODIES = {
    CHAT: CONTEXT,
    MESSAGES: json.dumps(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": f"{blocks(EXAMPLE_DOCS[:3])} Q?"}]}
    ).encode(),
    RESPONSES: json.dumps({"model": "m", "input": f"{blocks(EXAMPLE_DOCS[:3])}\n\n{EXAMPLE_QUESTION}"}).encode(),
    COMPRESS: json.dumps({"question": EXAMPLE_QUESTION, "documents": [d["text"] for d in EXAMPLE_DOCS[:3]]}).encode(),
}


class Spy:
    """rag-opt's real pipeline (BM25 scorer), recording the documents it was asked to optimize."""

    def __init__(self) -> None:
        self.inner = bm25_optimizer()
        self.calls: list[list[dict[str, Any]]] = []

    def optimize(self, query: str, documents: Any, **kwargs: Any) -> Any:
        self.calls.append([dict(d) for d in documents])
        return self.inner.optimize(query, documents, **kwargs)


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


@pytest.fixture(scope="module")
def proxy(upstream: tuple[FakeUpstream, str]) -> Iterator[str]:
    """The default proxy on loopback, no proxy key, with the operator's upstream key (the asset a page is after)."""
    with serve_proxy(upstream[1], bm25_optimizer(), upstream_api_key=UPSTREAM_KEY) as (url, _):
        yield url


# -- CSRF and DNS rebinding --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", JSON_PATHS)
@pytest.mark.parametrize(
    "ctype", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_page_posting_a_simple_non_json_body_is_refused(upstream, proxy, path, ctype):
    """The content types a page may POST cross-site without a CORS preflight: refused on the JSON routes, before
    anything is optimized or forwarded with the operator's key."""
    fake = upstream[0]
    n = len(fake.requests)
    status, _, body = raw_request(proxy, "POST", path, BODIES[path], {"Content-Type": ctype})
    assert status == 415, body
    if path != MESSAGES:
        assert error_code(body) == "unsupported_media_type"
    else:
        assert json.loads(body)["type"] == "error"  # Anthropic's shape on its route
    assert len(fake.requests) == n


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", None])
def test_json_bodies_and_bodies_without_a_type_are_still_served(upstream, proxy, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    status, got, _ = raw_request(proxy, "POST", CHAT, CONTEXT, headers)
    assert status == 200 and got["x-ragopt-status"] == "optimized"


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "https://evil.example"},
        {"Origin": "null"},  # a sandboxed frame, a file:// page
        {"Origin": "http://localhost:3000"},  # another local web app
        {"Sec-Fetch-Site": "cross-site"},  # a no-cors request without an Origin
        {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
    ],
    ids=["foreign", "null", "other-port", "fetch-site", "both"],
)
@pytest.mark.parametrize(("method", "path"), [("POST", CHAT), ("GET", "/v1/models"), ("POST", "/v1/embeddings")])
def test_cross_origin_browser_requests_never_reach_the_upstream(upstream, proxy, headers, method, path):
    fake = upstream[0]
    n = len(fake.requests)
    body = CONTEXT if path == CHAT else b'{"model": "e", "input": "x"}' if method == "POST" else b""
    status, _, answer = raw_request(proxy, method, path, body, {"Content-Type": "application/json", **headers})
    assert status == 403 and error_code(answer) == "cross_origin_request", answer
    assert len(fake.requests) == n


@pytest.mark.parametrize(
    "headers", [{}, {"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}, {"Origin": "own"}]
)
def test_same_origin_and_non_browser_requests_are_served(upstream, proxy, headers):
    if headers.get("Origin") == "own":
        headers = {"Origin": f"http://127.0.0.1:{_port(proxy)}"}
    status, _, _ = raw_request(proxy, "GET", "/v1/models", headers=headers)
    assert status == 200
    assert upstream[0].last("/v1/models").header("authorization") == f"Bearer {UPSTREAM_KEY}"


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:{port}", "127.0.0.1.nip.io:{port}", "localhost.attacker.example"]
)
@pytest.mark.parametrize(("method", "path"), [("POST", CHAT), ("GET", "/v1/models"), ("GET", "/metrics")])
def test_a_rebound_host_name_is_refused(upstream, proxy, host, method, path):
    """DNS rebinding: the page's own name now points at 127.0.0.1, so the browser sends it as the Host."""
    fake = upstream[0]
    n = len(fake.requests)
    body = CONTEXT if method == "POST" else b""
    status, _, answer = raw_request(
        proxy, method, path, body, {"Content-Type": "application/json"}, host=host.format(port=_port(proxy))
    )
    assert status == 403 and error_code(answer) == "host_not_allowed", answer
    assert b"attacker" not in answer and b"nip.io" not in answer  # the Host is never echoed
    assert len(fake.requests) == n


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LocalHost.:{port}"])
def test_the_listen_address_and_loopback_names_are_served(upstream, proxy, host):
    status, _, _ = raw_request(proxy, "GET", "/v1/models", host=host.format(port=_port(proxy)))
    assert status == 200


def test_probes_answer_whatever_the_host(proxy):
    for path in ("/livez", "/healthz", "/readyz"):
        status, _, _ = raw_request(proxy, "GET", path, host="attacker.example")
        assert status == 200


def test_allowed_hosts_extend_the_names_and_a_wildcard_listen_address_takes_ip_addresses(upstream):
    with serve_proxy(upstream[1], bm25_optimizer(), allowed_hosts="proxy.internal, .corp.example") as (url, _):
        for host in ["proxy.internal:8000", "corp.example", "api.corp.example:443", "localhost"]:
            assert raw_request(url, "GET", "/v1/models", host=host)[0] == 200, host
        for host in ["evil.example", "corp.example.evil.example", "10.0.0.7:8000"]:
            assert raw_request(url, "GET", "/v1/models", host=host)[0] == 403, host
    with serve_proxy(upstream[1], bm25_optimizer(), host="0.0.0.0") as (url, _):
        for host in ["10.0.0.7:8000", "[fd00::1]:8000", "localhost:1"]:
            assert raw_request(url, "GET", "/v1/models", host=host)[0] == 200, host
        assert raw_request(url, "GET", "/v1/models", host="rebound.example:8000")[0] == 403
    with serve_proxy(upstream[1], bm25_optimizer(), allowed_hosts="*") as (url, _):
        assert raw_request(url, "GET", "/v1/models", host="anything.example")[0] == 200


def test_host_policy():
    policy = HostPolicy.build("192.168.1.5", "api.example.com")
    assert policy.allows("192.168.1.5") and policy.allows("api.example.com")
    assert not policy.allows("localhost") and not policy.allows("10.0.0.1")
    assert host_name("Example.COM.:80") == "example.com" and host_name("[::1]:8000") == "::1"
    assert host_name("::1") is None and host_name("a:b") is None and host_name("[::1]x") is None
    with pytest.raises(ValueError, match="host name"):
        ProxySettings(upstream="http://x/v1", allowed_hosts="bad host/name")


# -- clients that never read ---------------------------------------------------------------------------------
BIG = json.dumps({"id": "x", "object": "list", "data": "a" * 12_000_000}).encode()  # more than the socket buffers


async def _big_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (msg := await receive())["type"] != "lifespan.shutdown":
            await send({"type": msg["type"] + ".complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BIG)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BIG, "more_body": False})


def test_a_client_that_never_reads_a_large_answer_is_cut_off_at_the_send_timeout():
    """12 MB of JSON to a client that reads nothing: the proxy held it (and its upstream response) for as long
    as the client kept the connection open. Now it aborts the connection after --send-timeout."""
    with ServerThread(_big_upstream) as up, serve_proxy(up.url, Spy(), send_timeout=0.5) as (url, state):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(WAIT_S)
        sock.connect(("127.0.0.1", _port(url)))
        try:
            sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{_port(url)}\r\n\r\n".encode())

            def cut() -> bool:
                m = parse_metrics(httpx.get(f"{url}/metrics", timeout=WAIT_S).text)
                return m.get('ragopt_local_errors_total{kind="send_timeout"}', 0) >= 1

            wait_until(cut)
            got = 0
            try:
                while chunk := sock.recv(1 << 20):
                    got += len(chunk)
            except ConnectionResetError:
                pass
            assert got < len(BIG)  # the answer was cut off, not delivered late
            wait_until(lambda: upstream_pool_is_clean(state))  # and its upstream response closed
        finally:
            sock.close()
        assert httpx.get(f"{url}/livez", timeout=WAIT_S).status_code == 200


def test_a_client_that_reads_gets_the_whole_large_answer():
    with ServerThread(_big_upstream) as up, serve_proxy(up.url, Spy(), send_timeout=WAIT_S) as (url, _):
        r = httpx.get(f"{url}/v1/models", timeout=WAIT_S)
        assert r.status_code == 200 and r.content == BIG


# -- Anthropic block rules ------------------------------------------------------------------------------------
def _render(raw: bytes, kept: dict[int, str]) -> bytes:
    """The body forwarded when the optimizer keeps documents ``kept`` (index: text) and drops the others."""
    plan = plan_messages(raw, {}, ProxySettings(upstream="http://127.0.0.1:9/v1"))
    n = len(plan.documents)
    result = OptimizeResult(
        query="Q?",
        documents=[OutputDocument(id=str(i), index=i, text=t) for i, t in kept.items()],
        dropped=[OutputDocument(id=str(i), index=i, text="") for i in range(n) if i not in kept],
        tokens_before=10,
        tokens_after=2,
        target_tokenizer="o200k_base",
        scorer="probe",
    )
    return plan.render(result)


def _messages(content: list[dict[str, Any]], system: Any = None) -> bytes:
    body: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}
    if system is not None:
        body["system"] = system
    return json.dumps(body).encode()


EPHEMERAL = {"type": "ephemeral"}


def test_a_dropped_blocks_cache_breakpoint_moves_to_the_nearest_kept_block():
    raw = _messages(
        [
            {"type": "text", "text": "Intro."},
            {"type": "text", "text": "<document>Dropped one.</document>", "cache_control": EPHEMERAL},
            {"type": "text", "text": "<document>Kept two.</document> Q?"},
        ],
        system=[
            {
                "type": "text",
                "text": "<document>Dropped sys.</document>",
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            },
            {"type": "text", "text": "Be terse."},
        ],
    )
    out = json.loads(_render(raw, {2: "Kept two."}))
    # the system's first block went: its breakpoint (with its ttl) is on the block after it, the only one left
    assert out["system"] == [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    # the message's dropped block went: its breakpoint is on the block before it
    assert out["messages"][0]["content"] == [
        {"type": "text", "text": "Intro.", "cache_control": EPHEMERAL},
        {"type": "text", "text": "<document>Kept two.</document> Q?"},
    ]


def test_a_breakpoint_is_not_doubled_on_a_block_that_has_one():
    raw = _messages(
        [
            {"type": "text", "text": "Intro.", "cache_control": EPHEMERAL},
            {"type": "text", "text": "<document>Dropped.</document>", "cache_control": EPHEMERAL},
            {"type": "text", "text": "<document>Kept.</document> Q?"},
        ]
    )
    content = json.loads(_render(raw, {1: "Kept."}))["messages"][0]["content"]
    assert content == [
        {"type": "text", "text": "Intro.", "cache_control": EPHEMERAL},
        {"type": "text", "text": "<document>Kept.</document> Q?"},
    ]


def _document(text: str, citations: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": text}}
    if citations:
        block["citations"] = {"enabled": True}
    return block


def test_dropped_documents_stay_as_placeholders_when_citations_are_on():
    """A citation's document_index counts the request's document blocks: dropping one would make every later
    citation point at the wrong document."""
    raw = _messages(
        [
            _document("First, dropped.", citations=False),
            _document("Second, kept. Cut.", citations=True),
            _document("Third, dropped.", citations=True),
            {"type": "text", "text": "Q?"},
        ]
    )
    content = json.loads(_render(raw, {1: "Second, kept."}))["messages"][0]["content"]
    assert [b["type"] for b in content] == ["document", "document", "document", "text"]
    assert [b["source"]["data"] for b in content[:3]] == [PLACEHOLDER, "Second, kept.", PLACEHOLDER]
    assert content[2]["citations"] == {"enabled": True}
    # without citations, dropped documents go as before
    plain = _messages([_document("One.", False), _document("Two. Cut.", False), {"type": "text", "text": "Q?"}])
    content = json.loads(_render(plain, {1: "Two."}))["messages"][0]["content"]
    assert [b["type"] for b in content] == ["document", "text"] and content[0]["source"]["data"] == "Two."


# -- the proxy key ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["a", "k3y", "x" * (MIN_PROXY_KEY_CHARS - 1)])
def test_a_short_proxy_key_is_refused(key):
    """A one-character key stripped every header with that character (the key is removed wherever it appears)."""
    with pytest.raises(ValueError, match=f"at least {MIN_PROXY_KEY_CHARS} characters"):
        ProxySettings(upstream="http://x/v1", api_key=key)
    with pytest.raises(ConfigurationError, match="RAG_OPT_API_KEY"):
        ProxySettings.from_sources({}, {"RAG_OPT_UPSTREAM": "http://x/v1", "RAG_OPT_API_KEY": key})
    assert ProxySettings(upstream="http://x/v1", api_key="x" * MIN_PROXY_KEY_CHARS).api_key is not None
    assert ProxySettings(upstream="http://x/v1", upstream_api_key="k").upstream_api_key is not None  # not ours


def _b64(data: bytes, urlsafe: bool = False) -> str:
    return (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(data).decode()


KEY = PROXY_KEY.encode()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Authorization", "Basic " + _b64(b"user:" + KEY).rstrip("=")),  # unpadded
        ("Authorization", "Basic " + _b64(b"us:" + KEY + b":x")),
        ("X-Custom", _b64(KEY)),
        ("X-Custom", _b64(b"a" + KEY)),
        ("X-Custom", _b64(b"ab" + KEY)),
        ("X-Custom", _b64(b"\xfb\xff" + KEY, urlsafe=True)),
        ("X-Custom", KEY.hex()),
        ("X-Custom", "".join(f"%{b:02X}" for b in KEY)),
    ],
    ids=["basic-unpadded", "basic", "b64", "b64-1", "b64-2", "b64-urlsafe", "hex", "percent-encoded"],
)
def test_the_proxy_key_never_reaches_the_upstream_encoded(upstream, name, value):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy(), api_key=PROXY_KEY) as (url, _):
        headers = {"X-RagOpt-Api-Key": PROXY_KEY, name: value, "X-Unrelated": "keep-me"}
        assert raw_request(url, "GET", "/v1/models", headers=headers)[0] == 200
    rec = fake.last("/v1/models")
    assert rec.header(name.lower()) is None and rec.header("x-unrelated") == "keep-me"


@pytest.mark.parametrize(
    "query",
    [f"api_key={PROXY_KEY}", f"key={quote(PROXY_KEY)}", f"token={_b64(KEY)}", f"a=b%3Bk%3D{PROXY_KEY}"],
)
def test_the_proxy_key_in_the_query_string_never_reaches_the_upstream(upstream, query):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy(), api_key=PROXY_KEY) as (url, _):
        path = f"/v1/models?limit=2&{query}&order=asc"
        assert raw_request(url, "GET", path, headers={"Authorization": f"Bearer {PROXY_KEY}"})[0] == 200
    rec = fake.last("/v1/models")
    assert rec.query == "limit=2&order=asc"


# -- paths ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path",
    [
        "/v1/..;/admin",
        "/v1/models/..;/..;/admin",
        "/v1/.;/models",
        "/v1/%2e%2e;x/admin",
        "/v1/;x/models",
        "/v1/%252e%252e/admin",
        "/v1/%25252e%25252e/admin",
        "/v1/models%252F..%252F..%252Fadmin",
        "/v1/%c0%ae%c0%ae/admin",
        "/v1/models%c0%af..%c0%afadmin",
        "/v1/%e0%80%ae%e0%80%ae/admin",
        "/v1/..%20/admin",
    ],
)
def test_path_traversal_spellings_are_refused(upstream, path):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy(), upstream_api_key=UPSTREAM_KEY) as (url, _):
        n = len(fake.requests)
        status, _, body = raw_request(url, "GET", path)
        assert status == 400 and error_code(body) == "invalid_path", body
        assert len(fake.requests) == n


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions;",
        "/v1/chat/completions;x=1",
        "/v1/chat/completions%3B",
        "/v1/chat/completions%20",
        "/v1/chat/completions%20%20",
        "/v1/chat/completions.",
        "/v1/chat%20/completions",
        "/v1/messages%20",
        "/v1/messages;a",
        "/v1/responses;",
        "/v1/responses%C2%A0",
        "/v1/compress%20",
        "/v1/%EF%BD%83hat/completions",  # a fullwidth "c"
    ],
)
def test_suffixed_spellings_of_the_local_routes_are_refused(upstream, path):
    """Another server may read them as the route itself: they must not bypass the optimization (the rag_opt
    field reaching the upstream) nor the route's checks."""
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy()) as (url, _):
        n = len(fake.requests)
        status, _, body = raw_request(url, "POST", path, CONTEXT, {"Content-Type": "application/json"})
        assert status == 400 and json.loads(body)["error"].get("code", "invalid_path") == "invalid_path", body
        assert len(fake.requests) == n


def test_plain_paths_with_spaces_or_percents_inside_a_segment_are_forwarded(upstream):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy()) as (url, _):
        for path in ["/v1/models/my%20model", "/v1/files/file-a%25b/content", "/v1/models/ft:gpt-4o:org;v=2"]:
            n = len(fake.requests)
            assert raw_request(url, "GET", path)[0] == 404  # the fake upstream's answer: it was forwarded
            assert len(fake.requests) == n + 1
    assert set(LOCAL_PATHS) >= {CHAT, MESSAGES, RESPONSES, COMPRESS}


# -- headers --------------------------------------------------------------------------------------------------
CLIENT_IP_HEADERS = [
    "CF-Connecting-IP",
    "X-Originating-IP",
    "Client-IP",
    "True-Client-IP",
    "Fastly-Client-IP",
    "X-Remote-IP",
    "X-Original-URL",
]


def test_client_ip_headers_from_an_untrusted_peer_are_removed(upstream):
    fake = upstream[0]
    spoofed = {name: "1.2.3.4" for name in CLIENT_IP_HEADERS}
    with serve_proxy(upstream[1], Spy()) as (url, _):
        assert raw_request(url, "GET", "/v1/models", headers=spoofed)[0] == 200
        rec = fake.last("/v1/models")
        assert [n for n in CLIENT_IP_HEADERS if rec.header(n.lower()) is not None] == []
        assert rec.header("x-forwarded-for") == "127.0.0.1"
    with serve_proxy(upstream[1], Spy(), trusted_proxies="127.0.0.0/8") as (url, _):
        assert raw_request(url, "GET", "/v1/models", headers=spoofed)[0] == 200
        rec = fake.last("/v1/models")
        assert all(rec.header(n.lower()) == "1.2.3.4" for n in CLIENT_IP_HEADERS)


TOKEN_HEADERS = {
    "X-Custom-Token": "custom-token-value-81",
    "X-Auth-Token": "auth-token-value-82",
    "X-Goog-Api-Key": "goog-key-value-83",
    "X-Amz-Security-Token": "amz-token-value-84",
    "X-Session-Id": "session-value-85",
    "X-Client-Secret": "client-secret-value-86",
}


def test_log_bodies_redacts_custom_token_headers(upstream, caplog):
    caplog.set_level(logging.DEBUG)
    with serve_proxy(upstream[1], Spy(), log_bodies=True) as (url, _):
        headers = {**TOKEN_HEADERS, "Content-Type": "application/json", "X-Trace": "visible-trace-id"}
        assert raw_request(url, "POST", CHAT, CONTEXT, headers)[0] == 200
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "visible-trace-id" in logged and "x-custom-token: [redacted]" in logged
    for secret in TOKEN_HEADERS.values():
        assert secret not in logged


@pytest.mark.parametrize(
    ("method", "path", "headers", "expected"),
    [
        (
            "POST",
            "/v1/messages/count_tokens",
            {"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"},
            "x-api-key",
        ),
        ("POST", "/v1/messages/batches", {"x-api-key": CLIENT_KEY}, "x-api-key"),
        ("GET", "/v1/models", {"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"}, "x-api-key"),
        ("POST", MESSAGES, {"x-api-key": CLIENT_KEY, "authorization": f"Bearer {CLIENT_KEY}"}, "x-api-key"),
        ("GET", "/v1/models", {"authorization": f"Bearer {CLIENT_KEY}", "x-api-key": CLIENT_KEY}, "authorization"),
        ("POST", CHAT, {"api-key": CLIENT_KEY, "x-api-key": CLIENT_KEY}, "authorization"),
    ],
    ids=["count-tokens", "batches", "anthropic-models", "messages", "openai-models", "chat"],
)
def test_the_upstream_gets_only_the_operators_key(upstream, method, path, headers, expected):
    """With --upstream-api-key, every client credential is replaced by it, sent once: as x-api-key to Anthropic
    (a path under /v1/messages, an anthropic-version header), else as a bearer token."""
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy(), upstream_api_key=UPSTREAM_KEY) as (url, _):
        body = BODIES.get(path, b'{"model": "m"}') if method == "POST" else b""
        raw_request(url, method, path, body, {"Content-Type": "application/json", **headers})
    rec = fake.requests[-1]
    assert rec.path == path
    credentials = [(k, v) for k, v in rec.headers if k in ("authorization", "x-api-key", "api-key")]
    value = UPSTREAM_KEY if expected == "x-api-key" else f"Bearer {UPSTREAM_KEY}"
    assert credentials == [(expected, value)]


# -- Markdown code ---------------------------------------------------------------------------------------------
FENCED = 'How do I parse this?\n\n```xml\n<document id="x">Example markup. It is code.</document>\n```\n'
INLINE = "What does `<document>` mean, and what does ``</document>`` close?"


def test_document_tags_in_markdown_code_are_left_alone(upstream):
    fake = upstream[0]
    spy = Spy()
    question = f"{FENCED}\n{INLINE}\n\n{EXAMPLE_QUESTION}"
    body = chat(f"{blocks(EXAMPLE_DOCS[:3])}\n\n{question}", rag_opt={"ratio": 0.3})
    with serve_proxy(upstream[1], spy) as (url, _):
        status, got, _ = raw_request(url, "POST", CHAT, body, {"Content-Type": "application/json"})
        assert status == 200 and got["x-ragopt-status"] == "optimized"
    assert [d["id"] for d in spy.calls[0]] == [d["id"] for d in EXAMPLE_DOCS[:3]]  # not the code's "x"
    content = fake.last().json()["messages"][0]["content"]
    assert content.endswith(question)  # the code, byte for byte


@pytest.mark.parametrize(
    "body",
    [
        "Wrap a passage as `<document>text</document>` to mark it.",
        "The `<document>` tag opens one; ``</document>`` ends it.",
        "An example:\n```xml\n<document>text</document>\n```\nThat is all.",
    ],
    ids=["inline-pair", "inline-lone", "fenced-pair"],
)
def test_markup_quoted_as_code_inside_a_document_stays_inside_it(body):
    text = f"<document>{body}</document>\n\nQ?"
    assert [text[b.body_start : b.body_end] for b in scan(text).documents] == [body]


@pytest.mark.parametrize(
    "text",
    [
        "<document>He said ``hi''</document>\n<document>She said ``bye''</document>",  # stray backticks
        "<document>one\n```python\nx = 1</document>\n<document>y = 2\n```\nend</document>",  # a fence cut in two
        "<document>a\n```\nnever closed</document>\n<document>b</document>",  # an unclosed fence is not code
        "<document>```py\nx = 1\n```\n</document>\n<document>```py\ny = 2\n```\n</document>",  # fences by tags
        # fences that pair up across the tags: each region holds one lone tag (found by test_properties)
        "<document>```\ncode = 1\n```\n</document>\n```\ncode = 1\n```\n<document>```\ncode = 1\n```\n</document>",
    ],
    ids=["quotes", "chunked-fence", "unclosed-fence", "fence-after-tag", "fence-lone-tag"],
)
def test_code_that_pairs_with_tags_outside_it_does_not_hide_documents(text):
    assert len(scan(text).documents) == 2


def test_code_spans():
    text = "a `b` c\n\n```\n<x>\n```\n`unclosed\n\nd`"
    assert [text[s:e] for s, e in code_spans(text)] == ["`b`", "```\n<x>\n```"]
    assert code_spans("no code at all") == []


# -- the serve command ---------------------------------------------------------------------------------------
def test_serve_takes_the_new_flags_and_refuses_a_short_key(monkeypatch, capsys):
    import uvicorn

    from rag_opt.cli import main

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(kw))
    argv = ["serve", "--upstream", "http://up/v1", "--no-warmup", "--allowed-hosts", "rag-opt", "--send-timeout", "5"]
    assert main(argv) == 0
    assert calls[0]["http"].send_timeout == 5
    assert main(["serve", "--upstream", "http://up/v1", "--no-warmup", "--api-key", "short"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err and len(calls) == 1
