"""``rag-opt mcp`` as a client that misbehaves sees it, over raw stdio: every unreadable line gets a JSON-RPC error,
a call is limited as ``rag-opt serve`` limits a request, and the server stops at once on SIGTERM (also where it
was started with SIGTERM ignored) or when the client goes away mid-call."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp.server.mcpserver", reason="the mcp extra (mcp 2) is not installed: pip install -e '.[mcp]'")

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 120  # a hang guard only: every answer below comes in well under a second once the server is up


class Server:
    """``rag-opt mcp ARGS`` on pipes, initialized."""

    def __init__(self, args: list[str], log: Path, ignore_sigterm: bool = False) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        env.setdefault("OMP_NUM_THREADS", "1")
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rag_opt.cli", "mcp", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            cwd=str(ROOT),
            env=env,
            # as a host that starts its servers with SIGTERM ignored (the disposition is inherited)
            preexec_fn=(lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)) if ignore_sigterm else None,
        )
        self.send(
            {
                "jsonrpc": "2.0",
                "id": 0,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "t", "version": "1"},
                },
            }
        )
        assert self.reply()["id"] == 0
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def send_raw(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def send(self, message: dict[str, Any]) -> None:
        self.send_raw(json.dumps(message).encode())

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], GUARD_S)
        assert ready, f"no reply within {GUARD_S} s; server log:\n{self.log.read_text()[-2000:]}"
        line = self.proc.stdout.readline()
        assert line, f"the server closed its stdout; log:\n{self.log.read_text()[-2000:]}"
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, rid: int, question: str, documents: list[Any]) -> None:
        arguments = {"question": question, "documents": documents}
        self.send(
            {
                "jsonrpc": "2.0",
                "id": rid,
                "method": "tools/call",
                "params": {"name": "optimize_context", "arguments": arguments},
            }
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(GUARD_S)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def start(*args: str, ignore_sigterm: bool = False) -> Server:
        server = Server(list(args), tmp_path / f"server{len(started)}.log", ignore_sigterm)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def _tool_error(reply: dict[str, Any]) -> str:
    assert reply["result"]["isError"] is True, reply
    return " ".join(c.get("text", "") for c in reply["result"]["content"])


def test_every_unreadable_line_gets_a_json_rpc_error(servers: Any) -> None:
    server = servers("--max-body-bytes", "2000")
    lone = b'{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "optimize_context", '
    lone += b'"arguments": {"question": "q \\ud800?", "documents": ["Some text."]}}}'
    cases = [
        (b"this is not json", None, -32700, "not JSON"),
        (lone, 2, -32700, "lone UTF-16 surrogate"),
        (b'{"jsonrpc": "2.0", "id": "s", "method": "ping", "params": {"\\udfff": 1}}', "s", -32700, "surrogate"),
        (b'{"jsonrpc": "2.0", "id": 4, "method": 5}', 4, -32600, "Invalid Request"),
        (b'{"jsonrpc": "2.0", "id": 5}', None, -32600, "Invalid Request"),
        (b"[1, 2]", None, -32600, "Invalid Request"),
        (b"\xff\xfe{", None, -32700, "not JSON"),
        (
            b'{"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {"x": "' + b"a" * 5000 + b'"}}',
            None,
            -32600,
            "over 2000 bytes",
        ),
    ]
    for line, rid, code, words in cases:
        server.send_raw(line)
        reply = server.reply()
        assert reply["id"] == rid and reply["error"]["code"] == code, (line[:60], reply)
        assert words in reply["error"]["message"]
        server.send({"jsonrpc": "2.0", "id": 99, "method": "ping"})  # and the server goes on
        assert server.reply() == {"jsonrpc": "2.0", "id": 99, "result": {}}
    assert "Traceback" not in server.log.read_text()


@pytest.mark.model
def test_a_call_is_limited_as_a_server_request_is(servers: Any) -> None:
    from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION

    docs = [d["text"] for d in EXAMPLE_DOCS[:4]]
    server = servers("--max-documents", "3", "--max-question-tokens", "20")
    server.call(1, EXAMPLE_QUESTION, docs)
    assert "4 documents, more than this server's limit of 3 (--max-documents)" in _tool_error(server.reply())
    server.call(2, " ".join(["why"] * 40), docs[:3])
    assert "the question has 40 tokens, more than the limit of 20" in _tool_error(server.reply())
    server.call(3, EXAMPLE_QUESTION, docs[:3])
    reply = server.reply()
    assert reply["result"]["isError"] is False and reply["result"]["structuredContent"]["tokens_after"] > 0
    # the time budget: an optimization past it is cancelled, and the server goes on
    timed = servers("--time-budget-ms", "1")
    timed.call(1, EXAMPLE_QUESTION, docs)
    assert "ran past this server's time budget of 1 ms (--time-budget-ms)" in _tool_error(timed.reply())
    timed.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})
    assert timed.reply()["id"] == 2


def _busy(servers: Any, **kwargs: Any) -> Server:
    """A server in the middle of a long call (hundreds of documents, no time budget to speak of)."""
    server = servers("--time-budget-ms", "86400000", **kwargs)
    docs = [f"Document {i} is about topic {i % 17}. It says more about item {i} and its parts." for i in range(900)]
    server.call(1, "What is said about topic 3?", docs)
    server.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})  # answered while the call runs
    assert server.reply()["id"] == 2
    time.sleep(1)
    assert server.proc.poll() is None
    return server


@pytest.mark.model
def test_sigterm_stops_the_server_in_the_middle_of_a_call(servers: Any) -> None:
    server = _busy(servers, ignore_sigterm=True)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(GUARD_S) == 128 + signal.SIGTERM
    assert "optimize_context: 900 documents" not in server.log.read_text()  # cancelled, not finished


@pytest.mark.model
def test_a_client_that_goes_away_cancels_its_call(servers: Any) -> None:
    server = _busy(servers)
    assert server.proc.stdin is not None
    server.proc.stdin.close()
    assert server.proc.wait(GUARD_S) == 0
    assert "optimize_context: 900 documents" not in server.log.read_text()  # cancelled, not finished
