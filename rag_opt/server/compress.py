"""``POST /v1/compress``: the compress-only sidecar. A gateway sends a question and its retrieved documents and
gets the optimized documents back (kept text, kept spans as character offsets into the input, scores, tokens
before and after, the tier that ran, timings, how the proxy model read the context and, under parallel encoding
with ``--expose-cache-hits``, the request's encoding cache hits and misses), then makes its own LLM call. The
encoding cache is read in the request's tenant namespace (``--cache-namespace``:
:func:`rag_opt.server.tenancy.request_namespace`).

The request and response are the pydantic models of :mod:`rag_opt.wire.compress_protocol`, read and answered by
the transport-free :mod:`rag_opt.wire.compress`; their JSON schema is served at ``GET /v1/compress/schema`` and
committed as ``docs/compress.schema.json`` (:func:`rag_opt.wire.compress.compress_schema`). The route only
translates: the optimization runs through the same :class:`~rag_opt.server.engine.Engine` as chat
completions (worker pool, micro-batching, the lexical tier when the model is saturated, time budget, work
limits), behind the same key check, body limit and metrics.

With ``explain: true`` the answer adds ``explanation``: every document's units with why each was kept or dropped
(:func:`rag_opt.explanation.explain_result`, at most :data:`~rag_opt.types.MAX_EXPLAINED_UNITS` listed). With
``--otel`` each request is an OpenTelemetry span (:mod:`rag_opt.telemetry`).

Outcomes: ``optimized`` / ``optimized_lexical`` (by the proxy model / the lexical tier), ``unchanged`` (the
budget asked for no compression), ``fail_open`` (the optimizer could not help: the documents come back as sent,
with ``reason``, as the proxy forwards a chat request unoptimized). Invalid input is a 400 whose OpenAI-style
error names the field (``param``); with ``--on-overload reject`` an overload is a 429.

The request is read strictly: JSON types are not coerced (``"ratio": "0.5"`` and ``"target_tokens": true`` are
400s), a key given twice in one object or a string holding a lone UTF-16 surrogate anywhere in the body is a 400
(``duplicate_key``, ``lone_surrogate``: the rule of every route, :mod:`rag_opt.wire.request`), and a
``budget`` must give one of its limits (``{}`` is a 400: leave ``budget`` out for the server's). A
body sent with ``Content-Encoding: gzip`` or ``deflate`` is decoded (at most ``--max-body-bytes`` once decoded,
else a 413). More than ``--max-documents`` documents is a 413 (``too_many_documents``), answered once the body
is parsed and before any document is validated or built. Reading the request and building the answer (the
documents as sent, on fail-open) run off the event loop for large bodies.

A body with ``messages`` is in the other contract this route answers, Headroom's (``{"messages": [...],
"model"?, "config"?}``, which gateways call): :mod:`rag_opt.server.compress_messages`.
"""

from __future__ import annotations

import time

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response

from rag_opt.errors import InvalidInputError
from rag_opt.server.compress_messages import MessagesCompressor
from rag_opt.server.engine import Engine, overloaded_response
from rag_opt.server.errors import Overloaded, error_response
from rag_opt.server.state import ProxyState
from rag_opt.server.tenancy import request_namespace
from rag_opt.wire.compress import (
    fail_open_response,
    load_body,
    optimized_response,
    read_request,
    request_job,
    result_status,
)
from rag_opt.wire.compress_messages_protocol import is_messages_body
from rag_opt.wire.compress_protocol import COMPRESS_PATH, CompressResponse
from rag_opt.wire.errors import RequestError
from rag_opt.wire.job import Attempt, Job
from rag_opt.wire.offload import off_loop
from rag_opt.wire.request import decode_body

__all__ = ["Compressor"]


class Compressor:
    """The ``/v1/compress`` flow of one app."""

    def __init__(self, state: ProxyState, engine: Engine) -> None:
        self.state = state
        self.engine = engine
        self.messages = MessagesCompressor(state, engine)  # the messages contract (Headroom's)

    def _refused(self, message: str, param: str | None, code: str = "invalid_request", status: int = 400) -> Response:
        self.state.metrics.compress_outcome("rejected")
        self.state.metrics.local_error("too_large" if status == 413 else "invalid_request")
        return error_response(status, message, "invalid_request_error", code, param)

    async def handle(self, request: Request, raw: bytes) -> Response:
        """Answer one compress request whose body is ``raw``."""
        s, t0 = self.state.settings, time.perf_counter()
        try:
            encoding = request.headers.get("content-encoding", "")
            if encoding.strip().lower() not in ("", "identity"):
                raw = await off_loop(len(raw), lambda: decode_body(raw, encoding, s.max_body_bytes))
            data = await off_loop(len(raw), lambda: load_body(raw))
            if is_messages_body(data):  # Headroom's contract: {"messages": [...], "model"?, "config"?}
                return await self.messages.handle(request, data, len(raw))
            req, documents = await off_loop(len(raw), lambda: read_request(data, s.max_documents))
        except RequestError as exc:
            return self._refused(exc.message, exc.param, exc.code, exc.status)
        job = request_job(req, documents, s.wire, request_namespace(s, request.headers))
        if req.tier == "lexical" and not self.engine.lexical_available(job.ordering):
            why = self.engine.no_lexical_note(job.ordering) or "the lexical tier is off on this server"
            return self._refused(f"tier: {why}", "tier")
        if req.target is not None and (refused := await self._check_target(req.target)) is not None:
            return refused
        try:
            attempt = await self.engine.run(job)
        except Overloaded as exc:  # --on-overload reject, and no lexical tier
            self.state.metrics.compress_outcome("overloaded")
            return overloaded_response(exc, s.time_budget_ms)

        def answer() -> bytes:  # with its span (--otel), under the status it answers
            out = self._answer(job, attempt, req.explain)
            self.state.tracing.record(request.headers, out.status, out.reason, attempt.result, t0, COMPRESS_PATH)
            return out.model_dump_json().encode()

        # the answer holds every document (all of them, as sent, on fail-open): built off the loop when large
        body = await off_loop(len(raw), answer)
        return Response(body, media_type="application/json")

    async def _check_target(self, target: str) -> Response | None:
        """A 400 for a target tokenizer this server does not allow (``--allowed-targets``), or that could not be
        loaded (None: it is loaded). Only an allowed one is ever loaded; the message names no server path."""
        try:
            await anyio.to_thread.run_sync(self.state.targets.load, target)
        except InvalidInputError as exc:
            return self._refused(f"target: {exc}", "target")
        return None

    def _answer(self, job: Job, attempt: Attempt, explain: bool = False) -> CompressResponse:
        s = self.state.settings
        # the language used: the request's, else the optimizer's own (the server's --language, for the one it built)
        language = job.language or getattr(self.state.optimizer, "language", None) or s.options.language
        result = attempt.result
        if result is None:
            self.state.metrics.compress_outcome("fail_open")
            return fail_open_response(job, attempt, language)
        status = result_status(attempt)
        ms = self.engine.record(attempt, len(job.documents), job.target or result.target_tokenizer)
        self.state.metrics.compress_outcome(status)
        return optimized_response(job, attempt, status, ms, language, s.expose_cache_hits, explain)
