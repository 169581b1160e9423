"""The risks of the third adversarial review (issue 52) that need no model: a repeated credential header,
encoded copies of the proxy key, a truncated upstream answer, redaction of keys in logged text, and one rule for
lone surrogates and duplicate keys on every route.

Runnable alone: ``python -m pytest tests/test_server_review3.py``. uvicorn on 127.0.0.1 runs the proxy (with the
serving options of ``rag-opt serve``) and a recording upstream (tests/upstream_server.py); raw sockets send what
an HTTP client library would refuse to, and play an upstream that breaks off its answer. Optimizations use
rag-opt's real pipeline with the BM25 scorer. Every wait is bounded; nothing depends on the machine's speed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from rag_opt.server.security import body_for_log, redact
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION
from tests.upstream_server import (
    FakeUpstream,
    ServerThread,
    bm25_optimizer,
    parse_metrics,
    request_body,
    serve_proxy,
)

PROXY_KEY = "rk-review3-proxy-Qm27"
KEY = PROXY_KEY.encode()
WAIT_S = 60.0  # the most any answer is waited for: a bound, never a speed budget
CHAT, COMPRESS = "/v1/chat/completions", "/v1/compress"


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def raw_request(
    url: str, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b""
) -> tuple[int, bytes]:
    """One request on a fresh socket, with ``headers`` as given (repeated names too); the status and the body."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{_port(url)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    lines += [f"Content-Length: {len(body)}", "Connection: close"]
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=WAIT_S) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        buf = b""
        while chunk := sock.recv(65536):
            buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


def post(url: str, body: bytes, path: str = CHAT) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=WAIT_S)


def blocks(docs: list[dict[str, Any]]) -> str:
    return "\n".join(f'<document id="{d["id"]}">{d["text"]}</document>' for d in docs)


# -- a credential header sent twice ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", "Bearer wrong-key-000000"), ("Authorization", f"Bearer {PROXY_KEY}")],  # wrong, then right
        [("Authorization", f"Bearer {PROXY_KEY}"), ("authorization", "Bearer wrong-key-000000")],
        [("Authorization", f"Bearer {PROXY_KEY}"), ("Authorization", f"Bearer {PROXY_KEY}")],  # even the same one
        [("X-RagOpt-Api-Key", "wrong-key-000000"), ("X-RagOpt-Api-Key", PROXY_KEY)],
        [("X-RagOpt-Api-Key", PROXY_KEY), ("x-api-key", "sk-client-a"), ("X-Api-Key", "sk-client-b")],
        [("X-RagOpt-Api-Key", PROXY_KEY), ("api-key", "azure-a"), ("api-key", "azure-b")],
        [("X-RagOpt-Api-Key", PROXY_KEY), ("x-goog-api-key", "g-a"), ("x-goog-api-key", "g-b")],
    ],
    ids=["wrong-then-right", "right-then-wrong", "same-twice", "ragopt-key", "x-api-key", "api-key", "goog-key"],
)
def test_a_repeated_credential_header_is_a_400_and_never_forwarded(upstream, headers):
    fake = upstream[0]
    with serve_proxy(upstream[1], bm25_optimizer(), api_key=PROXY_KEY) as (url, _):
        n = len(fake.requests)
        status, body = raw_request(url, "GET", "/v1/models", headers)
        assert status == 400, body
        err = json.loads(body)["error"]
        assert err["code"] == "duplicate_header" and headers[-1][0].lower() in err["message"]
        assert len(fake.requests) == n
        # the same request with the header once is served
        name = headers[-1][0].lower()
        same = [h for h in headers if h[0].lower() == name]
        once = [h for h in headers if h[0].lower() != name] + [next((h for h in same if PROXY_KEY in h[1]), same[0])]
        assert raw_request(url, "GET", "/v1/models", once)[0] == 200


def test_a_repeated_authorization_is_a_400_without_a_proxy_key(upstream):
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        headers = [("Authorization", "Bearer sk-client-a"), ("Authorization", "Bearer sk-client-b")]
        assert raw_request(url, "GET", "/v1/models", headers)[0] == 400
        assert raw_request(url, "GET", "/v1/models", headers[:1])[0] == 200


# -- the proxy key, encoded -----------------------------------------------------------------------------------
def _pct(data: bytes) -> str:
    return "".join(f"%{b:02X}" for b in data)


@pytest.mark.parametrize(
    "value",
    [
        quote(_pct(KEY)),  # percent-encoded twice
        quote(quote(_pct(KEY))),  # three times
        _pct(KEY).lower(),
        "".join(f"%u{b:04X}" for b in KEY),  # JavaScript's escape()
        "".join(f"\\u{b:04x}" for b in KEY),  # a JSON string's escapes
        quote("Basic " + base64.b64encode(b"user:" + KEY).decode(), safe=""),
    ],
    ids=["twice", "three-times", "lower-case", "percent-u", "json-escape", "basic-percent"],
)
def test_a_percent_encoded_proxy_key_never_reaches_the_upstream(upstream, value):
    fake = upstream[0]
    with serve_proxy(upstream[1], bm25_optimizer(), api_key=PROXY_KEY) as (url, _):
        headers = [("X-RagOpt-Api-Key", PROXY_KEY), ("X-Custom", value), ("X-Unrelated", "keep-me")]
        assert raw_request(url, "GET", f"/v1/models?a=1&copy={quote(value, safe='')}&b=2", headers)[0] == 200
    rec = fake.last("/v1/models")
    assert rec.header("x-custom") is None and rec.header("x-unrelated") == "keep-me"
    assert rec.query == "a=1&b=2"


# -- a truncated upstream answer ------------------------------------------------------------------------------
class ShortBodyUpstream:
    """A raw-socket upstream that answers 200 with a JSON Content-Length larger than the body it sends, then
    closes the connection."""

    def __init__(self, declared: int = 400, body: bytes = b'{"object": "list", "data": [') -> None:
        self.answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            declared,
            body,
        )
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), conn:
                conn.settimeout(WAIT_S)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("method_path", [("GET", "/v1/models"), ("POST", CHAT)])
def test_a_truncated_upstream_answer_is_named_as_such(method_path, caplog):
    caplog.set_level(logging.WARNING, logger="rag_opt.server.upstream")
    server = ShortBodyUpstream()
    try:
        with serve_proxy(server.url, None, connect_timeout=60, read_timeout=60) as (url, _):
            method, path = method_path
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
            r = httpx.request(method, f"{url}{path}", content=body if method == "POST" else None, timeout=WAIT_S)
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["code"] == "upstream_truncated_response" and err["type"] == "upstream_error"
            assert "truncated" in err["message"] and "28 bytes of the 400" in err["message"], err["message"]
            assert "could not reach" not in err["message"]
            metrics = parse_metrics(httpx.get(f"{url}/metrics", timeout=WAIT_S).text)
            assert metrics['ragopt_upstream_errors_total{kind="stream"}'] == 1
    finally:
        server.close()
    assert any("broke off after 28 bytes of the 400" in r.getMessage() for r in caplog.records)


# -- redaction of --log-bodies --------------------------------------------------------------------------------
SHAPED = {
    "google": "AIzaSyD3-fake-0123456789abcdefghijklmnop",
    "github": "ghp_0123456789abcdefghijklmnopqrstuvwxyzAB",
    "github-pat": "github_pat_11AAAAAAA0123456789_abcdefghijklmnopqrstuvwxyz0123",
    "openai": "sk-proj-0123456789abcdefghij",
    "slack-bot": "xoxb-123456789012-1234567890123-AbCdEfGhIjKl",
    "slack-user": "xoxp-1234567890-abcdefghijkl",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
}


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_redaction_covers_well_known_key_shapes_in_free_text(name):
    secret = SHAPED[name]
    text = f"Here is my key {secret}, please keep it."
    out = redact(text)
    assert secret not in out and "[redacted]" in out
    assert out.startswith("Here is my key ") and out.endswith(", please keep it.")


@pytest.mark.parametrize(
    ("text", "gone"),
    [
        ("login with password=hunter2-x and go", "hunter2-x"),
        ("my passwd: s3cr3t! here", "s3cr3t!"),
        ("api_key = abc123def then", "abc123def"),
        ("ACCESS_TOKEN=tok.123.abc&x=1", "tok.123.abc"),
        ('{"body": "{\\"api_key\\": \\"custom-7-secret\\", \\"model\\": \\"m\\"}"}', "custom-7-secret"),
        ('{"echo": "{\\"messages\\": [], \\"password\\": \\"pw-\\\\\\"q\\"}"}', "pw-"),
    ],
    ids=["password=", "passwd:", "api_key =", "access_token=", "escaped-json", "escaped-json-quote"],
)
def test_redaction_covers_secrets_in_text_and_in_escaped_json(text, gone):
    out = redact(text)
    assert gone not in out and "[redacted]" in out


def test_redaction_of_json_members_is_unchanged_by_its_bound_on_names():
    # member names are matched up to 40 characters either side of the credential word (a linear-time scan of long
    # texts full of quotes): the names clients use are all within it
    text = json.dumps(
        {
            "aws_secret_access_key": "v-1",
            "openai_api_key": "v-2",
            "x-goog-api-key": "v-3",
            "Authorization": "Bearer v-4",
            "nested": {"client_secret": 'v-"5"'},
            "keep": "visible",
        }
    )
    out = redact(text)
    assert json.loads(out)["nested"]["client_secret"] == "[redacted]" and json.loads(out)["keep"] == "visible"
    for gone in ("v-1", "v-2", "v-3", "v-4", "v-"):
        assert gone not in out
    quotes = '\\"token\\" "secret\\" ' * 5000  # quotes, escaped quotes and credential words, no member: kept
    assert redact(quotes) == quotes


def test_redaction_keeps_ordinary_text():
    text = 'The tokens: 512. A password policy. {"model": "gpt-4o", "max_tokens": 5} sk-short AKIA1234'
    assert redact(text) == text


@pytest.mark.parametrize(
    "encoded",
    [quote(PROXY_KEY, safe=""), _pct(KEY), _pct(KEY).lower(), quote(_pct(KEY)), "rk-review3%2Dproxy%2DQm27"],
    ids=["quote", "all-bytes", "lower-case", "twice", "in-part"],
)
def test_redaction_removes_percent_encoded_secrets(encoded):
    out = redact(f"GET https://x.example/cb?next=https%3A%2F%2Fy%2F%3Fk%3D{encoded}&z=1", [PROXY_KEY])
    assert encoded not in out and "[redacted]" in out and out.endswith("&z=1")


def test_a_key_across_the_log_cut_is_still_redacted():
    secret = SHAPED["github"]
    body = ("x" * (64 * 1024 - 10) + " " + secret + " tail").encode()
    logged = body_for_log(body)
    assert secret not in logged and secret[:10] not in logged


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An upstream that answers with the request it got (its body as a JSON string, and its headers)."""
    body = await request_body(scope, receive, send)
    if body is None:
        return
    answer = json.dumps(
        {
            "id": "chatcmpl-echo",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "echo": {"body": body.decode(), "headers": {k.decode(): v.decode() for k, v in scope["headers"]}},
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def test_log_bodies_redacts_keys_in_message_text_and_in_an_echoed_request(caplog):
    caplog.set_level(logging.DEBUG)
    custom = "my-custom-secret-Zx9"
    content = "My keys: " + ", ".join(SHAPED.values()) + f". And password={custom}. Where is Paris?"
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "api_key": custom}
    with ServerThread(_echo) as echo, serve_proxy(echo.url, bm25_optimizer(), log_bodies=True) as (url, _):
        r = httpx.post(f"{url}{CHAT}", json=body, headers={"x-api-key": "sk-client-key-123456"}, timeout=WAIT_S)
        assert r.status_code == 200 and custom in r.text  # the client gets its answer as it is
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "response 200" in logged and "chatcmpl-echo" in logged  # the echoed answer was logged ...
    for secret in [*SHAPED.values(), custom, "sk-client-key-123456"]:
        assert secret not in logged  # ... without a key


# -- one rule for lone surrogates and duplicate keys -----------------------------------------------------------
DOCS = EXAMPLE_DOCS[:3]
LONE = "Broken \\ud800 text."  # as a JSON escape: the string holds U+D800 alone


def _chat_raw(content_json: str, extra: str = "") -> bytes:
    return ('{"model": "m", "messages": [{"role": "user", "content": ' + content_json + "}]" + extra + "}").encode()


def _in_json(text: str) -> str:
    """``text`` as a JSON string whose ``@LONE@`` marks hold the raw escape (json.dumps would escape its backslash)."""
    return json.dumps(text).replace("@LONE@", LONE)


CHAT_REFUSED = {
    "document": (
        _chat_raw(_in_json(f'{blocks(DOCS)}\n<document id="bad">@LONE@</document>\n\n{EXAMPLE_QUESTION}')),
        "messages[0].content",
    ),
    "extension-document": (
        _chat_raw(
            _in_json(EXAMPLE_QUESTION), ', "rag_opt": {"documents": [{"text": "ok."}, {"text": "' + LONE + '"}]}'
        ),
        "rag_opt.documents[1].text",
    ),
    "extension-metadata": (
        _chat_raw(
            _in_json(EXAMPLE_QUESTION),
            ', "rag_opt": {"documents": [{"text": "ok.", "metadata": {"k": "' + LONE + '"}}]}',
        ),
        "rag_opt.documents[0].metadata.k",
    ),
    "question": (_chat_raw(_in_json(f"{blocks(DOCS)}\n\nWhere @LONE@ is it?")), None),
    "part": (
        _chat_raw('[{"type": "text", "text": ' + _in_json(f"<document>@LONE@</document> {EXAMPLE_QUESTION}") + "}]"),
        "messages[0].content[0].text",
    ),
}
COMPRESS_REFUSED = {
    "document": ('{"question": "Where?", "documents": ["ok.", "' + LONE + '"]}', "documents[1]"),
    "document-text": ('{"question": "Where?", "documents": [{"text": "' + LONE + '"}]}', "documents[0].text"),
    "question": ('{"question": "' + LONE + '", "documents": ["ok."]}', "question"),
    "metadata": (
        '{"question": "Where?", "documents": [{"text": "ok.", "metadata": {"k": "' + LONE + '"}}]}',
        "documents[0].metadata.k",
    ),
}


@pytest.mark.parametrize("case", sorted(CHAT_REFUSED))
def test_a_lone_surrogate_rag_opt_reads_is_a_400_on_chat(upstream, case):
    body, param = CHAT_REFUSED[case]
    fake = upstream[0]
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        n = len(fake.requests)
        r = post(url, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "lone_surrogate" and err["param"] == param and "lone UTF-16 surrogate" in err["message"]
        assert len(fake.requests) == n


@pytest.mark.parametrize("case", sorted(COMPRESS_REFUSED))
def test_a_lone_surrogate_is_the_same_400_on_compress(upstream, case):
    body, param = COMPRESS_REFUSED[case]
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        r = post(url, body.encode(), COMPRESS)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "lone_surrogate" and err["param"] == param and "lone UTF-16 surrogate" in err["message"]


def test_a_lone_surrogate_rag_opt_does_not_read_is_forwarded_as_sent(upstream):
    fake = upstream[0]
    # outside the context (an earlier turn, the user field, a system text outside blocks), and a request without
    # context at all: the upstream's to judge
    body = (
        '{"model": "m", "user": "' + LONE + '", "messages": ['
        '{"role": "system", "content": "Be brief ' + LONE + '"}, {"role": "user", "content": "' + LONE + '"}, '
        '{"role": "assistant", "content": "' + LONE + '"}, {"role": "user", "content": "Hi ' + LONE + '"}]}'
    ).encode()
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        r = post(url, body)
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "no_context", r.text
    assert fake.last().body == body


def test_a_surrogate_pair_is_text_on_both_routes(upstream):
    pair = "Rocket \\ud83d\\ude80 launch."
    chat = _chat_raw(json.dumps(f'{blocks(DOCS)}\n<document id="p">@PAIR@</document>\n\n{EXAMPLE_QUESTION}'))
    chat = chat.replace(b"@PAIR@", pair.encode())
    with serve_proxy(upstream[1], bm25_optimizer(), ratio=0.5) as (url, _):
        r = post(url, chat)
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "optimized", r.text
        r = post(url, ('{"question": "Where?", "documents": ["' + pair + '", "Other text."]}').encode(), COMPRESS)
        assert r.status_code == 200 and r.json()["status"] == "optimized", r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"question": "a?", "question": "b?", "documents": ["x."]}', "question"),
        ('{"question": "a?", "documents": ["x."], "documents": ["y."]}', "documents"),
        ('{"question": "a?", "documents": [{"text": "x.", "text": "y."}]}', "documents[0].text"),
        ('{"question": "a?", "documents": [{"text": "x.", "metadata": {"a": 1, "a": 2}}]}', "documents[0].metadata.a"),
        ('{"question": "a?", "documents": ["x."], "budget": {"ratio": 0.5, "ratio": 0.2}}', "budget.ratio"),
    ],
    ids=["question", "documents", "text", "metadata", "budget"],
)
def test_a_duplicate_key_is_a_400_on_compress_naming_it(upstream, body, param):
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        r = post(url, body.encode(), COMPRESS)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "duplicate_key" and err["param"] == param and "more than once" in err["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            ', "rag_opt": {"documents": [{"text": "x.", "metadata": {"a": 1, "a": 2}}]}',
            "rag_opt.documents[0].metadata.a",
        ),
        (', "rag_opt": {"query": "a?", "query": "b?"}', "rag_opt.query"),
    ],
    ids=["extension-metadata", "extension-query"],
)
def test_a_duplicate_key_rag_opt_reads_is_the_same_400_on_chat(upstream, extra, param):
    fake = upstream[0]
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        n = len(fake.requests)
        r = post(url, _chat_raw(json.dumps(f"{blocks(DOCS)} {EXAMPLE_QUESTION}"), extra))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "duplicate_key" and err["param"] == param and "more than once" in err["message"]
        assert len(fake.requests) == n


def test_a_number_too_long_is_a_400_on_compress(upstream):
    with serve_proxy(upstream[1], bm25_optimizer()) as (url, _):
        r = post(url, ('{"question": "a?", "documents": ["x."], "id": ' + "9" * 5000 + "}").encode(), COMPRESS)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
