"""The stdio transport of ``rag-opt mcp``: the MCP SDK's, with an answer for every line.

The SDK drops a line it cannot read as a JSON-RPC message without a word, so a client waits forever for the
answer to a request holding a lone UTF-16 surrogate (a ``\\ud800`` escape without its pair) or to a malformed
one. Here stdin is read line by line, each line checked before the SDK gets it: one that is not a JSON-RPC
message is answered with a JSON-RPC error and not passed on: ``-32700`` (parse error: not JSON, or a lone
surrogate), ``-32600`` (invalid request: JSON, but no JSON-RPC message, or a line over ``max_bytes``). The
answer carries the request's ``id`` when the line is a JSON object with a ``method`` and an ``id``, else
``null``. The SDK still serves stdout (it keeps stray output of the process off the wire).

Needs the ``mcp`` extra (imported when a transport is opened).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import anyio
import anyio.to_thread

from rag_opt.inputs import has_lone_surrogate

if TYPE_CHECKING:  # pragma: no cover
    from mcp.types import JSONRPCError

__all__ = ["check_message", "stdio_transport"]

logger = logging.getLogger(__name__)

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
_TOO_LARGE = object()  # a line over the limit (read to its end and dropped)
_SKIP = 1 << 16  # bytes read at a time while skipping the rest of a line over the limit


def _request_id(data: Any) -> str | int | None:
    """The id of a request (a JSON object with a method), None for anything else."""
    if not isinstance(data, dict) or "method" not in data:
        return None
    rid = data.get("id")
    return rid if isinstance(rid, str | int) and not isinstance(rid, bool) else None


def _error(rid: str | int | None, code: int, message: str) -> JSONRPCError:
    from mcp.types import ErrorData, JSONRPCError

    return JSONRPCError(jsonrpc="2.0", id=rid, error=ErrorData(code=code, message=message))


def check_message(line: str) -> JSONRPCError | None:
    """None when ``line`` is a JSON-RPC message the SDK reads; else the JSON-RPC error to answer it with."""
    from mcp.types import jsonrpc_message_adapter
    from pydantic import ValidationError

    try:
        jsonrpc_message_adapter.validate_json(line, by_name=False)
        return None
    except ValidationError as exc:
        first = exc.errors()[0]
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as exc:
        return _error(None, PARSE_ERROR, f"Parse error: the message is not JSON ({exc})")
    rid = _request_id(data)
    if has_lone_surrogate(data):
        return _error(
            rid,
            PARSE_ERROR,
            "Parse error: the message holds a lone UTF-16 surrogate (a \\ud800-style escape without its pair), "
            "which is not Unicode text",
        )
    if first["type"] == "json_invalid":  # JSON Python reads and MCP does not (NaN, Infinity, ...)
        return _error(rid, PARSE_ERROR, f"Parse error: {first['msg']}")
    return _error(
        rid, INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 request, notification or response MCP knows"
    )


class _Lines:
    """stdin's lines for the SDK's transport (an async iterator of text, as it reads its stdin): a line that is not
    a JSON-RPC message is answered on the transport's write stream (:meth:`attach`) and not passed on."""

    def __init__(self, source: BinaryIO, max_bytes: int) -> None:
        self._source = source
        self._max = max_bytes
        self._write: Any = None
        self._attached = anyio.Event()

    def attach(self, write_stream: Any) -> None:
        self._write = write_stream
        self._attached.set()

    def _readline(self) -> bytes | object | None:
        """The next line (None at the end of the input; :data:`_TOO_LARGE` for one over the limit)."""
        raw = self._source.readline(self._max + 1)
        if not raw:
            return None
        if len(raw) > self._max and not raw.endswith(b"\n"):
            while (rest := self._source.readline(_SKIP)) and not rest.endswith(b"\n"):
                pass
            return _TOO_LARGE
        return raw

    async def _answer(self, error: JSONRPCError) -> None:
        from mcp.shared.message import SessionMessage

        await self._attached.wait()
        logger.info("answered an unreadable message with a JSON-RPC error: %s", error.error.message[:200])
        try:
            await self._write.send(SessionMessage(error))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):  # the session is closing
            pass

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        while True:
            raw = await anyio.to_thread.run_sync(self._readline, abandon_on_cancel=True)
            if raw is None:
                raise StopAsyncIteration
            if raw is _TOO_LARGE:
                await self._answer(
                    _error(None, INVALID_REQUEST, f"Invalid Request: the message is over {self._max} bytes")
                )
                continue
            line = cast(bytes, raw).decode("utf-8", "replace")  # as the SDK decodes stdin
            if not line.strip():
                continue
            error = await anyio.to_thread.run_sync(check_message, line) if len(line) > _SKIP else check_message(line)
            if error is None:
                return line
            await self._answer(error)


@asynccontextmanager
async def stdio_transport(max_bytes: int, stdin: BinaryIO | None = None) -> AsyncIterator[tuple[Any, Any]]:
    """The SDK's ``stdio_server`` streams, with stdin read by :class:`_Lines` (lines over ``max_bytes`` bytes are
    refused without being held)."""
    from mcp.server.stdio import stdio_server

    lines = _Lines(stdin if stdin is not None else sys.stdin.buffer, max_bytes)
    async with stdio_server(stdin=cast(Any, lines)) as (read_stream, write_stream):
        lines.attach(write_stream)
        yield read_stream, write_stream
