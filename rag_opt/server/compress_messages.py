"""``POST /v1/compress`` with ``{"messages": [...], "model": "..."?, "config": {...}?}``: Headroom's contract, which
Kong AI Gateway (``provider: headroom``), LiteLLM's ``guardrail: headroom``, Portkey and Superwise call. The body is
told apart by its fields (:func:`rag_opt.wire.compress_messages_protocol.is_messages_body`): ``messages`` means
this contract, ``question``/``documents`` the documents contract of :mod:`rag_opt.server.compress`.

The answer is ``{"messages": [...], "tokens_before", "tokens_after", "tokens_saved", "compression_ratio",
"stats"}``: as many messages as were sent, in the same order, each the same JSON value as sent except for the
optimized texts (a message keeps its content shape). The context and the question are found by the proxy's planners
(:mod:`rag_opt.wire.conversation`: ``<document>`` blocks, tool results, JSON/CSV records; the question is the
latest user message before the context, else the arguments of the tool call it answers), and each context is
optimized through the app's :class:`~rag_opt.server.engine.Engine`, as a chat request's is. The token counts are
the context's, in the target tokenizer (0 when nothing was optimized); ``compression_ratio`` is
``tokens_after / tokens_before`` (1.0 when nothing was optimized). Reading the body, the contexts' jobs and the
answer are the transport-free :mod:`rag_opt.wire.compress_messages`'s; this route runs the jobs and answers.

Never fails a gateway's request for want of something to do: without context (``no_context``), without a question
to read it by (``no_query``), with ``x-ragopt-disable`` (``disabled``) or when the optimizer cannot help
(``fail_open``: its reason), the messages come back as sent, with the status and the reason in ``stats``. A
malformed body is a 400 naming the problem, as for the documents contract (not JSON, a duplicate key or a lone
surrogate anywhere, ``messages`` not a list of message objects, ``model`` not a string, an invalid ``config``
value); with ``--on-overload reject`` an overload is a 429.

``config`` takes rag-opt's options: the budget (``ratio``, ``target_tokens`` or ``threshold``), ``ordering``,
``language``, ``target`` (an allowed tokenizer, as the documents contract's) and ``tier``; the ``x-ragopt-*``
request headers apply under it, as on the chat routes. Keys rag-opt does not read (a gateway's own settings for
Headroom) and unknown top-level fields (session ids, ...) are ignored and listed in ``stats.ignored``. ``model``
names the LLM for the per-model totals of ``GET /stats`` (budgets count in the server's ``--target`` unless
``config.target`` says otherwise).

Metrics are the chat routes': ``ragopt_requests_total{route="compress"}`` (counted by the app),
``ragopt_compress_requests_total{outcome}`` once per request, and per optimized context the engine's record
(tokens before and after, latency, tier, documents) or its fail-open reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response

from rag_opt.errors import InvalidInputError
from rag_opt.server.engine import Engine, overloaded_response
from rag_opt.server.errors import Overloaded, error_response
from rag_opt.server.state import ProxyState
from rag_opt.server.tenancy import request_namespace
from rag_opt.wire.compress_messages import (
    MessagesContext,
    context_jobs,
    ignored_fields,
    messages_answer,
    read_messages,
    request_status,
)
from rag_opt.wire.compress_messages_protocol import MessagesConfig, MessagesRequest, Status
from rag_opt.wire.conversation import find_turns
from rag_opt.wire.errors import RequestError
from rag_opt.wire.json_edit import dumps
from rag_opt.wire.offload import off_loop

__all__ = ["MessagesCompressor"]

logger = logging.getLogger(__name__)


class MessagesCompressor:
    """The messages contract of one app's ``/v1/compress`` (see the module docstring)."""

    def __init__(self, state: ProxyState, engine: Engine) -> None:
        self.state = state
        self.engine = engine

    def _refused(self, exc: RequestError) -> Response:
        self.state.metrics.compress_outcome("rejected")
        self.state.metrics.local_error("too_large" if exc.status == 413 else "invalid_request")
        return error_response(exc.status, exc.message, "invalid_request_error", exc.code, exc.param)

    async def handle(self, request: Request, data: dict[str, Any], size: int) -> Response:
        """Answer one request whose parsed body is ``data`` (``size``: its length in bytes)."""
        t0 = time.perf_counter()
        headers = request.headers
        s = self.state.settings
        try:
            req = await off_loop(size, lambda: read_messages(data))
            config = req.config or MessagesConfig()
            await self._check(config)
        except RequestError as exc:
            return self._refused(exc)
        ignored = ignored_fields(data)
        if headers.get("x-headroom-bypass", "").strip().lower() == "true":  # Headroom proxy's own switch
            return await self._answer(headers, req, [], "disabled", "x-headroom-bypass", t0, size, config, ignored)
        try:
            turns = await off_loop(size, lambda: find_turns(req.messages, headers, s.wire))
        except RequestError as exc:  # a message the planner refuses, an invalid x-ragopt-* header
            return self._refused(exc)
        except Exception as exc:  # a bug here must not fail a gateway's request: the messages as sent
            logger.warning("finding the context failed (%s); returning the messages unchanged", self.state.why(exc))
            failed = self.engine.failed("error", t0)
            return await self._answer(headers, req, [], "fail_open", failed.told, t0, size, config, ignored)
        options = turns[0].plan.options if turns else None
        if options is not None and not options.enabled:
            return await self._answer(headers, req, [], "disabled", "x-ragopt-disable", t0, size, config, ignored)
        found = [t for t in turns if t.plan.documents]
        ready = [t for t in found if t.plan.query is not None]
        if not found:
            tag, least = s.document_tag, s.tool_min_chars
            why = f"no context in the messages (no <{tag}> blocks, no tool result of {least}+ characters)"
            return await self._answer(headers, req, [], "no_context", why, t0, size, config, ignored)
        if not ready:
            why = "no question to read the context by (no user message before it, no tool call arguments)"
            return await self._answer(headers, req, [], "no_query", why, t0, size, config, ignored)
        documents = [await off_loop(size, t.plan.optimizer_documents) for t in ready]
        if sum(map(len, documents)) > s.max_documents:  # one request's contexts together, as one chat request's
            attempt = self.engine.failed("limit", t0)
            return await self._answer(headers, req, [], "fail_open", attempt.told, t0, size, config, ignored)
        contexts = context_jobs(ready, documents, options, config, s.wire, request_namespace(s, headers))
        try:
            await self._run(contexts)
        except Overloaded as exc:  # --on-overload reject, and no lexical tier
            self.state.metrics.compress_outcome("overloaded")
            return overloaded_response(exc, s.time_budget_ms)
        for c in contexts:
            await self._write(c, req.model, size)
        status, reason = request_status(contexts)
        return await self._answer(headers, req, contexts, status, reason, t0, size, config, ignored)

    async def _check(self, config: MessagesConfig) -> None:
        """A RequestError for a tier or a target this server cannot serve (as for the documents contract)."""
        ordering = config.ordering or self.state.settings.options.ordering
        if config.tier == "lexical" and not self.engine.lexical_available(ordering):
            why = self.engine.no_lexical_note(ordering) or "the lexical tier is off on this server"
            raise RequestError(f"config.tier: {why}", "config.tier", "invalid_request")
        if config.target is not None:
            try:
                await anyio.to_thread.run_sync(self.state.targets.load, config.target)
            except InvalidInputError as exc:
                raise RequestError(f"config.target: {exc}", "config.target", "invalid_request") from None

    async def _run(self, contexts: list[MessagesContext]) -> None:
        """Optimize every context at once (the engine's pool and micro-batching share them); raises
        :class:`~rag_opt.server.errors.Overloaded` when one was refused under ``--on-overload reject``."""
        refused: list[Overloaded] = []

        async def one(c: MessagesContext) -> None:
            try:
                c.attempt = await self.engine.run(c.job)
            except Overloaded as exc:
                refused.append(exc)

        async with anyio.create_task_group() as tg:
            for c in contexts:
                tg.start_soon(one, c)
        if refused:
            raise refused[0]

    async def _write(self, c: MessagesContext, model: str | None, size: int) -> None:
        """Write ``c``'s result back into its messages and count it (as the chat routes do); a failure to write
        leaves them as sent (fail-open ``error``)."""
        attempt = c.attempt
        assert attempt is not None
        result = attempt.result
        if result is None:
            c.reason = attempt.told
            return
        try:
            c.written = await off_loop(size, lambda: c.turn.written(result))
        except Exception as exc:
            logger.warning(
                "writing the optimized context back failed (%s); returning it unchanged", self.state.why(exc)
            )
            c.reason = self.engine.failed("error", attempt.t0).told
            return
        self.engine.record(attempt, len(c.job.documents), model)
        if attempt.tier == "lexical":
            c.reason = attempt.reason

    async def _answer(
        self,
        headers: Mapping[str, str],
        req: MessagesRequest,
        contexts: list[MessagesContext],
        status: Status,
        reason: str | None,
        t0: float,
        size: int,
        config: MessagesConfig,
        ignored: list[str],
    ) -> Response:
        self.state.metrics.compress_outcome(status)
        done = [c.attempt.result for c in contexts if c.written is not None and c.attempt and c.attempt.result]
        self.state.tracing.record(headers, status, reason, done, t0, "/v1/compress")  # --otel: the request's span
        s = self.state.settings
        language = config.language or getattr(self.state.optimizer, "language", None) or s.options.language
        answer = messages_answer(req, contexts, status, reason, t0, config, ignored, language, s.wire)
        body = await off_loop(size, lambda: dumps(answer).encode("utf-8"))
        return Response(body, media_type="application/json")
