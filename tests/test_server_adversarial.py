"""The proxy attacked as an outsider would attack it (issue #12): every test is named after what it attacks.

Runnable alone: ``python -m pytest tests/test_server_adversarial.py``. uvicorn on 127.0.0.1 runs the proxy (with
the serving options of ``rag-opt serve``) and a recording upstream (tests/upstream_server.py); raw sockets send
what an HTTP client library would refuse to. No model is loaded: optimizations use rag-opt's real pipeline with
the BM25 scorer, or fakes that take exactly the time a test gives them. Nothing here depends on how fast the
machine is; the timeouts under test are short, and every wait is bounded.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from rag_opt.wire.chat import plan_request
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, cpu_seconds, pieces_in_order
from tests.upstream_server import (
    BudgetClock,
    FakeUpstream,
    ServerThread,
    bm25_optimizer,
    parse_metrics,
    serve_proxy,
)

DOCS = EXAMPLE_DOCS
QUESTION = EXAMPLE_QUESTION
PROXY_KEY = "rk-adversary-proxy-Q7w9"
WAIT_S = 60.0  # the most any condition below is waited for: a bound, never a speed budget


# -- helpers ---------------------------------------------------------------------------------------------------
@dataclass
class Raw:
    """One HTTP response read off a raw socket."""

    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool  # the server closed the connection after it

    def json(self) -> Any:
        return json.loads(self.body)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _read_response(sock: socket.socket) -> Raw | None:
    """Read one response (None: the server closed the connection without answering)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    if "content-length" in headers:
        while len(body) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    elif headers.get("transfer-encoding") == "chunked":
        while not body.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    closed = False
    if headers.get("connection", "").lower() == "close":
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
    return Raw(status, headers, body, closed)


def exchange(url: str, data: bytes, timeout: float = WAIT_S) -> Raw | None:
    """Send ``data`` on a fresh connection to the server at ``url`` and read one response."""
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=timeout) as sock:
        sock.sendall(data)
        return _read_response(sock)


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chat(content: str, **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra}).encode()


def post(url: str, body: bytes, path: str = "/v1/chat/completions", **kw: Any) -> httpx.Response:
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=WAIT_S, **kw)


def metrics(url: str, **kw: Any) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=WAIT_S, **kw).text)


def wait_until(cond: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def blocks(docs: list[dict[str, Any]]) -> str:
    return "\n".join(f'<document id="{d["id"]}">{d["text"]}</document>' for d in docs)


class Spy:
    """rag-opt's real pipeline (BM25 scorer), recording what it was asked to optimize."""

    def __init__(self) -> None:
        self.inner = bm25_optimizer()
        self.calls: list[tuple[str, list[dict[str, Any]]]] = []

    def optimize(self, query: str, documents: Any, **kwargs: Any) -> Any:
        self.calls.append((query, [dict(d) for d in documents]))
        return self.inner.optimize(query, documents, **kwargs)


class Windowed:
    """An optimizer that runs ``windows`` forward passes, each when the test hands it a permit, and checks
    between them whether its request gave up, as ``extract`` does between windows."""

    def __init__(self, windows: int = 50) -> None:
        self.windows = windows
        self.permits = threading.Semaphore(0)
        self.started = threading.Event()
        self.stopped = threading.Event()
        self.ran = 0

    def optimize(self, query: str, documents: Any, **kwargs: Any) -> Any:
        from rag_opt import work

        self.started.set()
        try:
            for _ in range(self.windows):
                work.checkpoint()
                assert self.permits.acquire(timeout=WAIT_S), "the test never released a window"
                self.ran += 1
        finally:
            self.stopped.set()
        raise AssertionError("ran every window although its request had given up")


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


def _balanced(text: str, tag: str = "document") -> bool:
    depth = 0
    for m in re.finditer(rf"<(/?){tag}\b[^>]*>", text):
        depth += -1 if m.group(1) else 1
        if depth < 0:
            return False
    return depth == 0


# -- 1. the document scanner: linear time ----------------------------------------------------------------------
def _unclosed(n: int) -> bytes:
    return chat("q? " + "<document>a" * n)


def test_unclosed_document_tags_take_linear_time():
    """The trigger was ``"q? " + "<document>a" * 8000``: the old regex took quadratic time on the event loop.
    Four times the tags must cost about four times the CPU time (a ratio on this machine, not a speed)."""
    small, large = _unclosed(2_000), _unclosed(8_000)
    t_small = cpu_seconds(lambda: plan_request(small, {}))
    t_large = cpu_seconds(lambda: plan_request(large, {}))
    assert t_large < 8 * t_small + 0.02, (t_small, t_large)


def test_a_long_blank_run_in_the_question_takes_linear_time():
    """The question's blank runs were collapsed by ``\\s*\\n\\s*``, which backtracks over a long run of
    spaces with no newline in it: quadratic, on the event loop."""
    small, large = chat("q?" + " " * 20_000 + "x"), chat("q?" + " " * 80_000 + "x")
    t_small = cpu_seconds(lambda: plan_request(small, {}))
    t_large = cpu_seconds(lambda: plan_request(large, {}))
    assert t_large < 8 * t_small + 0.02, (t_small, t_large)
    plan = plan_request(chat("<document>D.</document>\n  \n Which   one? \t\n\n  Now."), {})
    assert plan.query == "Which   one?\nNow."  # blank runs with a newline become one newline, others stay


def test_unclosed_document_tags_are_forwarded_as_text(upstream):
    fake = upstream[0]
    body = _unclosed(8_000)
    with serve_proxy(upstream[1], Spy()) as (url, _):
        r = post(url, body)
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "no_context"
        assert fake.last().body == body


# -- 2./3. the upstream URL ------------------------------------------------------------------------------------
def test_an_encoded_slash_cannot_send_the_request_to_another_host(upstream):
    fake, up_url = upstream
    other = FakeUpstream()
    with ServerThread(other) as other_server, serve_proxy(up_url, Spy(), upstream=up_url) as (url, _):
        n = len(fake.requests)
        for path in [
            f"/v1%2F@127.0.0.1:{_port(other_server.url)}/x",
            f"/v1%2f%40127.0.0.1:{_port(other_server.url)}/x",
        ]:
            headers = {"Cookie": "session=s3cret", "OpenAI-Organization": "org-victim"}
            r = exchange(url, request_bytes("GET", path, headers=headers))
            assert r is not None and r.status == 400, r
            assert r.json()["error"]["code"] == "invalid_path"
        assert other.requests == [] and len(fake.requests) == n


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../admin",
        "/v1/../../etc/passwd",
        "/v1/../key/generate",
        "/v1/%2e%2e/key/generate",
        "/v1/.%2E/key/generate",
        "/v1/models/../../admin",
        "/v1/./models",
        "/v1/models%2F..%2F..%2Fadmin",
        "/v1/models%5C..%5Cadmin",
    ],
)
def test_dot_segments_and_encoded_slashes_cannot_leave_the_upstream_base_path(upstream, path):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy(), upstream_api_key="sk-operator-key-123") as (url, _):
        n = len(fake.requests)
        r = exchange(url, request_bytes("GET", path))
        assert r is not None and r.status == 400, r
        err = r.json()["error"]
        assert err["code"] == "invalid_path" and err["type"] == "invalid_request_error" and err["message"]
        assert len(fake.requests) == n  # nothing reached the upstream, with or without the operator's key


# -- 4. bounded work -------------------------------------------------------------------------------------------
def test_ten_thousand_tiny_documents_are_not_queued(upstream):
    spy = Spy()
    body = chat("".join(f"<document>Tiny {i}.</document>" for i in range(10_000)) + "\n\nWhich one?")
    with serve_proxy(upstream[1], spy) as (url, state):  # the default limits
        r = post(url, body)
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "fail_open"
        assert r.headers["x-ragopt-reason"] == "limit"
        assert spy.calls == [] and state.pool.gauges()[:2] == (0, 0)  # never queued, no worker busy
        assert metrics(url)['ragopt_fail_open_total{reason="limit"}'] == 1
    assert upstream[0].last().body == body


def test_too_many_units_stop_the_optimization_before_scoring(upstream):
    from rag_opt import ContextOptimizer, work
    from rag_opt.compressors import BM25Scorer
    from rag_opt.errors import WorkLimitExceeded

    scored: list[int] = []

    class CountingScorer(BM25Scorer):
        def score(self, question: str, units: Any) -> Any:
            scored.append(units.n_units)
            return super().score(question, units)

    opt = ContextOptimizer(scorer=CountingScorer())
    docs = ["One. Two. Three. Four. Five. Six."]
    with work.scope(limits=work.WorkLimits(max_units=3)), pytest.raises(WorkLimitExceeded, match="units"):
        opt.optimize("Which?", docs, ratio=0.5)
    assert scored == []
    with serve_proxy(upstream[1], opt, max_units=3) as (url, _):
        r = post(url, chat(f"<document>{docs[0]}</document>\n\nWhich?"))
        assert r.headers["x-ragopt-status"] == "fail_open" and r.headers["x-ragopt-reason"] == "limit"
    assert scored == []


class _CharTokenizer:
    """A proxy tokenizer stand-in: one token per character."""

    def __call__(
        self, text: Any, add_special_tokens: bool = True, return_offsets_mapping: bool = False
    ) -> dict[str, Any]:
        if isinstance(text, str):
            out: dict[str, Any] = {"input_ids": list(range(len(text)))}
            if return_offsets_mapping:
                out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
            return out
        return {"input_ids": [list(range(len(t))) for t in text]}


def _fake_proxy() -> Any:
    return SimpleNamespace(num_layers=2, num_heads=2, max_positions=8192, tokenizer=_CharTokenizer(), name="fake")


def test_too_many_proxy_tokens_stop_before_the_first_forward_pass(monkeypatch):
    from rag_opt import work
    from rag_opt.errors import WorkLimitExceeded
    from rag_opt.models import extract as ex

    passes: list[Any] = []
    monkeypatch.setattr(ex, "_run_prompts", lambda *a: passes.append(a))
    docs = [["A sentence of forty characters, roughly."] * 5]
    with work.scope(limits=work.WorkLimits(max_proxy_tokens=100)), pytest.raises(WorkLimitExceeded, match="proxy"):
        ex.extract(_fake_proxy(), docs, "q?", max_tokens=512)
    assert passes == []


def test_a_cancelled_optimization_stops_between_forward_passes(monkeypatch):
    from rag_opt import work
    from rag_opt.errors import Cancelled
    from rag_opt.models import extract as ex

    cancel = threading.Event()
    passes: list[Any] = []

    def one_pass(proxy: Any, prompts: Any, layers: int, cross: bool = False) -> Any:
        passes.append(prompts)
        cancel.set()  # the request gives up during the first forward pass
        return [
            ex._Read(np.zeros((p.n_units, len(ex.VIEWS), 2, 2), np.float32), np.ones(p.n_units, np.int64), 10)
            for p in prompts
        ]

    monkeypatch.setattr(ex, "_run_prompts", one_pass)
    docs = [["x" * 300 + "."] for _ in range(6)]  # one document per 512-token window, one window per pass
    with work.scope(cancel=cancel), pytest.raises(Cancelled):
        ex.extract_batch(_fake_proxy(), [(docs, "q?")], max_tokens=512, batch_tokens=512)
    assert len(passes) == 1


def test_an_optimization_over_its_budget_frees_its_worker_at_the_next_window(upstream):
    opt = Windowed()
    clock = BudgetClock()
    with serve_proxy(upstream[1], opt, time_budget_ms=1_000) as (url, state):
        clock.install(state)
        r: list[httpx.Response] = []
        t = threading.Thread(target=lambda: r.append(post(url, chat(f"{blocks(DOCS[:2])}\n\n{QUESTION}"))))
        t.start()
        assert opt.started.wait(WAIT_S)
        clock.expire()  # the budget runs out while the first window runs
        t.join(WAIT_S)
        assert r and r[0].headers["x-ragopt-status"] == "fail_open" and r[0].headers["x-ragopt-reason"] == "timeout"
        assert state.pool.gauges()[1] == 1  # the worker is still in its first window
        opt.permits.release()  # that window ends: the next checkpoint stops the optimization
        assert opt.stopped.wait(WAIT_S)
        wait_until(lambda: state.pool.gauges()[1] == 0)
        assert opt.ran == 1
        m = metrics(url)
        assert m["ragopt_optimizer_cancelled_total"] == 1 and m["ragopt_optimizer_abandoned_finished_total"] == 1


# -- 5./6. nested tags and quoted attributes -------------------------------------------------------------------
def test_nested_document_tags_keep_their_inner_tags_and_stay_balanced(upstream):
    fake = upstream[0]
    inner = DOCS[1]["text"]
    content = (
        f'<document id="outer">Intro sentence here. <document id="inner" title="Inner">{inner}</document> '
        f'Outro sentence here.</document>\n<document id="d2">{DOCS[2]["text"]}</document>\n'
        f'<document id="open">{DOCS[3]["text"]} <document id="d4">{DOCS[4]["text"]}</document>\n\n{QUESTION}'
    )
    spy = Spy()
    with serve_proxy(upstream[1], spy, ratio=0.3) as (url, _):
        r = post(url, chat(content))
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "optimized"
    got = fake.last().json()["messages"][0]["content"]
    # the innermost blocks are the documents; a block around them keeps its tags and text, untouched
    assert [d.get("id") for d in spy.calls[0][1]] == ["inner", "d2", "d4"]
    assert got.startswith('<document id="outer">Intro sentence here. ')
    assert " Outro sentence here.</document>" in got
    assert f'<document id="open">{DOCS[3]["text"]} ' in got  # an opening tag never closed is text
    kept = re.findall(r'<document id="inner" title="Inner">(.*?)</document>', got, flags=re.S)
    assert len(kept) <= 1 and all(k.strip() and k.strip() in inner or pieces_in_order(k, inner) for k in kept)
    assert got.count("<document") - content.count("<document") == got.count("</document>") - content.count(
        "</document>"
    )  # tags are only ever removed in pairs
    assert _balanced(got.replace(f'<document id="open">{DOCS[3]["text"]} ', ""))


def test_a_quoted_greater_than_in_an_attribute_is_parsed_and_forwarded_intact(upstream):
    fake = upstream[0]
    spy = Spy()
    tags = ['<document id="d1" title="a>b">', "<document id='d2' title='x > y' data-x=\"<q>\">"]
    content = f"{tags[0]}{DOCS[0]['text']}</document>\n{tags[1]}{DOCS[1]['text']}</document>\n\n{QUESTION}"
    with serve_proxy(upstream[1], spy, ratio=0.9) as (url, _):
        r = post(url, chat(content))
        assert r.headers["x-ragopt-status"] == "optimized"
    sent = spy.calls[0][1]
    assert [(d["id"], d["title"]) for d in sent] == [("d1", "a>b"), ("d2", "x > y")]
    assert sent[0]["text"] == DOCS[0]["text"] and sent[1]["text"] == DOCS[1]["text"]
    got = fake.last().json()["messages"][0]["content"]
    for tag in tags:
        assert got.count(tag) <= 1
    assert all(tag in got for tag in tags if tag in got) and _balanced(got)
    assert 'b">' not in got.replace(tags[0], "")


# -- 7. over-long and malformed paths, unexpected errors -------------------------------------------------------
@pytest.mark.parametrize("length", [10_000, 70_000])
def test_an_overlong_path_gets_a_414_and_a_short_log(upstream, caplog, length):
    fake = upstream[0]
    caplog.set_level(logging.DEBUG)
    with serve_proxy(upstream[1], Spy()) as (url, _):
        n = len(fake.requests)
        caplog.clear()
        r = exchange(url, request_bytes("GET", "/v1/" + "a" * length))
        assert r is not None and r.status == 414, r
        assert r.json()["error"]["code"] == "uri_too_long"
        assert len(fake.requests) == n
        logged = caplog.text
    assert "Traceback" not in logged and len(logged) < 2_000, logged[:500]


def test_encoded_double_slashes_on_a_pathless_upstream_are_a_400_not_a_500(upstream, caplog):
    caplog.set_level(logging.DEBUG)
    fake, up_url = upstream
    with serve_proxy(up_url, Spy(), upstream=up_url) as (url, _):
        n = len(fake.requests)
        for path in ["/v1%2F%2Fexample.com/x", "/v1/%2F%2Fexample.com/x"]:
            r = exchange(url, request_bytes("GET", path))
            assert r is not None and r.status == 400 and r.json()["error"]["code"] == "invalid_path", r
        assert len(fake.requests) == n
    assert "Traceback" not in caplog.text


def test_an_unexpected_error_is_a_500_without_its_message_in_the_logs(upstream, caplog):
    caplog.set_level(logging.DEBUG)
    secret = "-".join(["SECRET", "CONTENT", "IN", "MESSAGE"])  # (not in the source lines the frames show)
    with serve_proxy(upstream[1], Spy()) as (url, state):

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(secret)

        state.upstream.forward = broken
        r = httpx.get(f"{url}/v1/models", timeout=WAIT_S)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert secret not in caplog.text
    assert "RuntimeError" in caplog.text  # the type and frames are logged, once
    assert sum("unexpected error" in rec.getMessage() for rec in caplog.records) == 1


# -- 8. the proxy key ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Authorization", f"Token {PROXY_KEY}"),
        ("Authorization", f"Bearer\t{PROXY_KEY}"),
        ("Authorization", f"bearer  {PROXY_KEY} "),
        ("api-key", PROXY_KEY),
        ("X-Api-Key", PROXY_KEY),
        ("X-Custom", f"prefix-{PROXY_KEY}-suffix"),
    ],
)
def test_the_proxy_key_never_reaches_the_upstream_in_another_header(upstream, name, value):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy(), api_key=PROXY_KEY) as (url, _):
        headers = {"X-RagOpt-Api-Key": PROXY_KEY, name: value}
        r = exchange(url, request_bytes("GET", "/v1/models", headers=headers))
        assert r is not None and r.status == 200, r
    rec = fake.last("/v1/models")
    assert all(PROXY_KEY not in k and PROXY_KEY not in v for k, v in rec.headers), rec.headers


# -- client-side timeouts, connection limits, log floods -------------------------------------------------------
def test_partial_headers_trickled_forever_are_closed_with_a_408(upstream):
    with serve_proxy(upstream[1], Spy(), header_timeout=0.5) as (url, _):
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=WAIT_S) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            deadline = time.monotonic() + WAIT_S
            try:  # a slowloris: one more header byte every 50 ms, never the end of the headers
                while time.monotonic() < deadline:
                    sock.sendall(b"X-Slow: a\r\n"[:1])
                    time.sleep(0.05)
            except OSError:
                pass  # the proxy closed the connection
            sock.settimeout(WAIT_S)
            r = _read_response(sock)
        assert r is not None and r.status == 408 and r.json()["error"]["code"] == "request_timeout"
        # a connection that sends nothing at all is closed too
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=WAIT_S) as sock:
            r = _read_response(sock)
            assert r is not None and r.status == 408


@pytest.mark.parametrize(
    "head",
    [
        b'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"model',
        b'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"mod\r\n',
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{",
    ],
    ids=["short-body", "endless-chunks", "passthrough"],
)
def test_a_body_that_never_arrives_is_closed_with_a_408(upstream, head):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy(), body_timeout=0.5) as (url, _):
        n = len(fake.requests)
        r = exchange(url, head)
        assert r is not None and r.status == 408 and r.closed, r
        assert r.json()["error"]["code"] == "request_timeout"
        assert len(fake.requests) == n


def test_connections_over_the_limit_are_refused_at_once(upstream):
    with serve_proxy(upstream[1], Spy(), max_connections=4, header_timeout=WAIT_S) as (url, _):
        idle = [socket.create_connection(("127.0.0.1", _port(url)), timeout=WAIT_S) for _ in range(4)]
        try:
            wait_until(lambda: exchange(url, request_bytes("GET", "/livez")) is not None)
            r = exchange(url, request_bytes("GET", "/livez"))
            assert r is not None and r.status == 503 and r.json()["error"]["code"] == "too_many_connections"
            idle.pop().close()

            def served() -> bool:
                r = exchange(url, request_bytes("GET", "/livez"))
                return r is not None and r.status == 200

            wait_until(served)
        finally:
            for s in idle:
                s.close()


@pytest.mark.slow
def test_an_idle_connection_flood_under_a_low_file_limit_keeps_the_proxy_serving(upstream, tmp_path):
    """260 idle connections against ``ulimit -n 256``: once wrote ~80,000 'Too many open files' tracebacks in
    12 s and starved every other client. Now the connections over the limit are refused at once, the idle ones
    are closed after the header timeout, normal requests are served, and the log stays short."""
    import os
    import resource

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "RAG_OPT_UPSTREAM": f"{upstream[1]}/v1",
        "RAG_OPT_PORT": str(port),
        "RAG_OPT_HEADER_TIMEOUT": "2",
    }
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rag_opt.cli", "serve", "--no-warmup"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
        )
        url = f"http://127.0.0.1:{port}"
        idle: list[socket.socket] = []
        try:
            deadline = time.monotonic() + WAIT_S * 2
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=WAIT_S).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, "rag-opt serve did not start"
                time.sleep(0.2)
            for _ in range(260):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT_S))

            def served() -> bool:
                try:
                    return httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(served, timeout=WAIT_S * 2)
            for s in idle:  # every idle connection was closed by the proxy (refused, or timed out)
                try:
                    while s.recv(65536):
                        pass
                except ConnectionResetError:
                    pass
        finally:
            for s in idle:
                s.close()
            proc.terminate()
            proc.wait(timeout=WAIT_S)
    text = log.read_text(errors="replace")
    assert text.count("Traceback") <= 2 and len(text) < 20_000, text[-2000:]


def test_repeated_log_lines_are_rate_limited(caplog):
    from rag_opt.server.logs import RepeatLimiter

    now = [0.0]
    limiter = RepeatLimiter(burst=5, window_s=60, clock=lambda: now[0])
    log = logging.getLogger("rag_opt.test.flood")
    log.addFilter(limiter)
    caplog.set_level(logging.INFO, logger="rag_opt.test.flood")
    try:
        for i in range(1_000):
            log.warning("upstream failed (%s)", f"attempt {i}")
        log.warning("another message")
        assert len(caplog.records) == 6
        now[0] = 61.0
        log.warning("upstream failed (%s)", "later")
        assert "995 similar" in caplog.records[-1].getMessage()
        log.info("an info line is never limited %s", 1)
        assert caplog.records[-1].levelno == logging.INFO
    finally:
        log.removeFilter(limiter)


def test_an_unreachable_upstream_does_not_flood_the_log(caplog):
    caplog.set_level(logging.WARNING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with serve_proxy(dead, Spy(), connect_timeout=5) as (url, _):
            with httpx.Client(timeout=WAIT_S) as c:
                for _ in range(60):
                    assert c.get(f"{url}/v1/models").status_code == 502
    failed = [r for r in caplog.records if "upstream failed" in r.getMessage()]
    assert 1 <= len(failed) <= 21


# -- request framing and headers -------------------------------------------------------------------------------
def test_transfer_encoding_with_content_length_is_refused_and_the_connection_closed(upstream):
    fake = upstream[0]
    body = chat("hi")
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    with serve_proxy(upstream[1], Spy()) as (url, _):
        n = len(fake.requests)
        r = exchange(url, head + chunked)
        assert r is not None and r.status == 400 and r.closed, r
        assert r.json()["error"]["code"] == "invalid_framing"
        assert len(fake.requests) == n


def test_client_forwarding_headers_are_replaced_by_the_real_peer(upstream):
    fake = upstream[0]
    spoofed = {
        "X-Forwarded-For": "1.2.3.4",
        "X-Real-IP": "1.2.3.4",
        "Forwarded": "for=1.2.3.4",
        "X-Forwarded-Host": "e",
    }
    with serve_proxy(upstream[1], Spy()) as (url, _):
        assert exchange(url, request_bytes("GET", "/v1/models", headers=spoofed)).status == 200
        rec = fake.last("/v1/models")
        assert rec.header("x-forwarded-for") == "127.0.0.1"
        assert rec.header("x-real-ip") is None and rec.header("forwarded") is None
        assert rec.header("x-forwarded-host") is None
    with serve_proxy(upstream[1], Spy(), trusted_proxies="127.0.0.0/8") as (url, _):
        assert exchange(url, request_bytes("GET", "/v1/models", headers=spoofed)).status == 200
        rec = fake.last("/v1/models")
        assert rec.header("x-forwarded-for") == "1.2.3.4, 127.0.0.1"
        assert rec.header("x-real-ip") == "1.2.3.4" and rec.header("forwarded") == "for=1.2.3.4"


@pytest.mark.parametrize("value", ["", "   ", "\t"])
@pytest.mark.parametrize("name", ["API_KEY", "UPSTREAM_API_KEY"])
def test_an_empty_key_variable_is_refused_like_an_empty_flag(name, value):
    from rag_opt.errors import ConfigurationError
    from rag_opt.server.settings import ProxySettings

    with pytest.raises(ConfigurationError, match=f"RAG_OPT_{name}"):
        ProxySettings.from_sources({}, {"RAG_OPT_UPSTREAM": "http://x/v1", f"RAG_OPT_{name}": value})
    with pytest.raises(ConfigurationError):
        ProxySettings.from_sources({"upstream": "http://x/v1", name.lower(): value}, {})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            b'{"model":"m","messages":[{"role":"user","content":"a"}],"messages":[{"role":"user","content":"b"}]}',
            "messages",
        ),
        (b'{"messages":[{"role":"user","content":"a","content":"<document>x.</document> q?"}]}', "messages[0].content"),
        (b'{"messages":[{"role":"user","role":"system","content":"a"}]}', "messages[0].role"),
        (
            b'{"messages":[{"role":"user","content":[{"type":"text","text":"a","text":"b"}]}]}',
            "messages[0].content[0].text",
        ),
        (b'{"messages":[{"role":"user","content":"q"}],"rag_opt":{"ratio":0.5},"rag_opt":{}}', "rag_opt"),
        (b'{"messages":[{"role":"user","content":"q"}],"rag_opt":{"ratio":0.5,"ratio":0.9}}', "rag_opt.ratio"),
        (
            b'{"messages":[{"role":"user","content":"q"}],"rag_opt":{"documents":[{"text":"a","text":"b"}]}}',
            "rag_opt.documents[0].text",
        ),
    ],
)
def test_duplicate_keys_the_proxy_reads_are_refused(upstream, body, param):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy()) as (url, _):
        n = len(fake.requests)
        r = post(url, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "duplicate_key" and err["param"] == param and "more than once" in err["message"]
        assert len(fake.requests) == n


def test_duplicate_keys_the_proxy_does_not_read_are_forwarded_as_sent(upstream):
    fake = upstream[0]
    body = b'{"model":"m","metadata":{"a":1,"a":2},"messages":[{"role":"user","content":"hi","name":"x","name":"y"}]}'
    with serve_proxy(upstream[1], Spy()) as (url, _):
        r = post(url, body)
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "no_context"
    assert fake.last().body == body


def test_a_lone_surrogate_document_is_a_400_naming_it_as_on_compress(upstream):
    # one rule on every route (issue 52): a text rag-opt reads that is not Unicode text is refused, never guessed
    fake = upstream[0]
    bad = "Broken \\ud800 text. It has a lone surrogate."  # a JSON escape: the document holds U+D800 alone
    before = json.dumps(f'{blocks(DOCS[:2])}\n<document id="bad">')[:-1]
    after = json.dumps(f"</document>\n{blocks(DOCS[2:4])}\n\n{QUESTION}")[1:]
    body = b'{"model":"m","messages":[{"role":"user","content":' + (before + bad + after).encode() + b"}]}"
    spy = Spy()
    with serve_proxy(upstream[1], spy, ratio=0.3) as (url, _):
        n = len(fake.requests)
        r = post(url, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "lone_surrogate" and err["param"] == "messages[0].content"
        compress = b'{"question": "q?", "documents": ["' + bad.encode() + b'"]}'
        r = post(url, compress, "/v1/compress")
        assert r.status_code == 400 and r.json()["error"]["code"] == "lone_surrogate", r.text
    assert spy.calls == [] and len(fake.requests) == n


@pytest.mark.parametrize(
    "path",
    [
        "/v1//chat/completions",
        "/v1/chat/completions/",
        "/v1/chat//completions",
        "/v1/Chat/Completions",
        "//v1/chat/completions",
    ],
)
def test_alternate_chat_paths_are_refused(upstream, path):
    fake = upstream[0]
    body = chat(f"{blocks(DOCS[:2])}\n\n{QUESTION}", rag_opt={"ratio": 0.5})
    with serve_proxy(upstream[1], Spy()) as (url, _):
        n = len(fake.requests)
        r = exchange(url, request_bytes("POST", path, body, {"Content-Type": "application/json"}))
        assert r is not None and r.status in (400, 404), r
        assert r.json()["error"]["code"] in ("invalid_path", "not_found")
        assert len(fake.requests) == n  # the rag_opt field never reaches the upstream


@pytest.mark.parametrize("method", ["PUT", "PATCH", "GET"])
def test_other_methods_on_the_chat_path_are_refused(upstream, method):
    fake = upstream[0]
    body = chat(f"{blocks(DOCS[:2])}\n\n{QUESTION}", rag_opt={"ratio": 0.5}) if method != "GET" else b""
    with serve_proxy(upstream[1], Spy()) as (url, _):
        n = len(fake.requests)
        r = exchange(url, request_bytes(method, "/v1/chat/completions", body, {"Content-Type": "application/json"}))
        assert r is not None and r.status == 405 and r.headers["allow"] == "POST", r
        assert r.json()["error"]["code"] == "method_not_allowed"
        assert len(fake.requests) == n


def test_no_redirect_is_built_from_the_client_host(upstream):
    with serve_proxy(upstream[1], Spy()) as (url, _):
        for path in ["/v1", "/healthz/", "/metrics/"]:
            r = exchange(
                url, request_bytes("GET", path, headers={"Host": "evil.example"}).replace(b"Host: 127.0.0.1\r\n", b"")
            )
            assert r is not None and not 300 <= r.status < 400, r
            assert "location" not in r.headers and b"evil.example" not in r.body


# -- compressed request bodies ---------------------------------------------------------------------------------
def test_a_gzip_chat_body_is_decoded_and_optimized(upstream):
    fake = upstream[0]
    body = chat(f"{blocks(DOCS[:3])}\n\n{QUESTION}")
    with serve_proxy(upstream[1], Spy(), ratio=0.4) as (url, _):
        r = post(url, gzip.compress(body), headers={"content-encoding": "gzip"})
        assert r.status_code == 200 and r.headers["x-ragopt-status"] == "optimized"
    rec = fake.last()
    assert rec.header("content-encoding") is None
    assert len(rec.json()["messages"][0]["content"]) < len(json.loads(body)["messages"][0]["content"])


@pytest.mark.parametrize(
    ("payload", "encoding", "status", "code"),
    [
        (lambda: gzip.compress(b" " * 20_000_000, 9), "gzip", 413, "request_too_large"),  # a gzip bomb
        (lambda: b"\x1f\x8b\x08\x00not gzip at all", "gzip", 400, "invalid_encoding"),
        (lambda: b"{}", "br", 415, "unsupported_encoding"),
        (lambda: b"{}", "gzip, gzip", 415, "unsupported_encoding"),
    ],
    ids=["bomb", "corrupt", "brotli", "stacked"],
)
def test_bad_compressed_chat_bodies_get_a_clear_error(upstream, payload, encoding, status, code):
    fake = upstream[0]
    with serve_proxy(upstream[1], Spy(), max_body_bytes=1_000_000) as (url, _):
        n = len(fake.requests)
        r = post(url, payload(), headers={"content-encoding": encoding})
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code and encoding.split(",")[0] in r.json()["error"]["message"]
        assert len(fake.requests) == n


# -- readiness -------------------------------------------------------------------------------------------------
class _SlowLoader:
    """An optimizer whose first call (the start-up warm-up) waits until the test lets it finish or fail."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.inner = bm25_optimizer()

    def optimize(self, query: str, documents: Any, **kwargs: Any) -> Any:
        assert self.release.wait(WAIT_S)
        if self.fail:
            raise RuntimeError("the model did not load")
        return self.inner.optimize(query, documents, **kwargs)


@pytest.mark.parametrize("fail", [False, True], ids=["loads", "fails"])
def test_readiness_waits_for_the_optimizer_to_settle(upstream, fail):
    opt = _SlowLoader(fail)
    with serve_proxy(upstream[1], opt, warmup=True, api_key=PROXY_KEY) as (url, _):
        assert httpx.get(f"{url}/livez").status_code == 200
        for path in ("/readyz", "/health"):
            r = httpx.get(f"{url}{path}")
            assert r.status_code == 503 and r.json()["optimizer"] == "loading"
        assert httpx.get(f"{url}/healthz").json()["optimizer"] == "loading"
        opt.release.set()
        wait_until(lambda: httpx.get(f"{url}/readyz").status_code == 200)
        health = httpx.get(f"{url}/health").json()
        assert health["optimizer"] == ("failed" if fail else "ready")
        assert health["mode"] == ("pass-through" if fail else "optimizing")
        assert httpx.get(f"{url}/livez").json() == {"status": "ok"}
