"""``POST /v1/compress`` with ``{"messages": [...], "model": "..."?, "config": {...}?}``: Headroom's contract, which
Kong AI Gateway (``provider: headroom``), LiteLLM's ``guardrail: headroom``, Portkey and Superwise call. The body is
told apart by its fields (:func:`is_messages_body`): ``messages`` means this contract, ``question``/``documents``
the documents contract of :mod:`rag_opt.server.compress`.

The answer is ``{"messages": [...], "tokens_before", "tokens_after", "tokens_saved", "compression_ratio",
"stats"}``: as many messages as were sent, in the same order, each the same JSON value as sent except for the
optimized texts (a message keeps its content shape). The context and the question are found by the proxy's planners
(:mod:`rag_opt.server.conversation`: ``<document>`` blocks, tool results, JSON/CSV records; the question is the
latest user message before the context, else the arguments of the tool call it answers), and each context is
optimized through the app's :class:`~rag_opt.server.engine.Engine`, as a chat request's is. The token counts are
the context's, in the target tokenizer (0 when nothing was optimized); ``compression_ratio`` is
``tokens_after / tokens_before`` (1.0 when nothing was optimized).

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
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from rag_opt.errors import InvalidInputError
from rag_opt.server.compress_messages_protocol import (
    MESSAGES_FIELD,
    ContextStats,
    MessagesConfig,
    MessagesRequest,
    MessagesResponse,
    MessagesStats,
    Status,
    is_messages_body,
    messages_schemas,
)
from rag_opt.server.conversation import Turn, find_turns
from rag_opt.server.engine import Attempt, Engine, Job, overloaded_response
from rag_opt.server.errors import Overloaded, RequestError, error_response
from rag_opt.server.json_edit import dumps
from rag_opt.server.pool import off_loop
from rag_opt.server.request import check_messages, check_readable
from rag_opt.server.state import ProxyState
from rag_opt.server.tenancy import request_namespace

__all__ = [
    "MESSAGES_FIELD",
    "ContextStats",
    "MessagesCompressor",
    "MessagesConfig",
    "MessagesRequest",
    "MessagesResponse",
    "MessagesStats",
    "is_messages_body",
    "messages_schemas",
]

logger = logging.getLogger(__name__)

_DOCUMENTS_FIELDS = ("question", "query", "documents")  # the documents contract's: not mixed with this one
_READ = frozenset({MESSAGES_FIELD, "model", "config"})
_MAX_IGNORED = 20  # names listed in stats.ignored (each cut to _MAX_NAME characters)
_MAX_NAME = 64


def _invalid(exc: ValidationError) -> RequestError:
    """The 400 for the first problem pydantic found, named by its place (``config.ratio``)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or None
    msg = "missing (required)" if err["type"] == "missing" else err["msg"].removeprefix("Value error, ")
    return RequestError(f"{where}: {msg}" if where else msg, where, "invalid_value")


def _ignored(data: Mapping[str, Any]) -> list[str]:
    names = [k for k in data if k not in _READ]
    config = data.get("config")
    if isinstance(config, dict):
        names += [f"config.{k}" for k in config if k not in MessagesConfig.model_fields]
    return [n[:_MAX_NAME] for n in names[:_MAX_IGNORED]]


def _read(data: dict[str, Any]) -> MessagesRequest:
    """The request in ``data`` (a parsed body with ``messages``), checked; raises RequestError."""
    mixed = [k for k in _DOCUMENTS_FIELDS if k in data]
    if mixed:
        raise RequestError(
            f"{mixed[0]}: a body has either messages (the messages contract) or question and documents (the "
            "documents contract), not both",
            mixed[0],
            "invalid_request",
        )
    check_readable(data)  # rag-opt reads the whole body: a duplicate key or a lone surrogate anywhere is a 400
    check_messages(data[MESSAGES_FIELD])
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


@dataclass
class _Context:
    """One turn with context and a question, and what became of it."""

    turn: Turn
    job: Job
    attempt: Attempt | None = None
    written: dict[int, Any] | None = None  # the changed messages (None: not optimized)
    reason: str | None = None

    def stats(self) -> ContextStats:
        result = self.attempt.result if self.attempt is not None and self.written is not None else None
        out = ContextStats(
            messages=self.turn.context_messages,
            question_from=self.turn.question_from,
            documents=len(self.job.documents),
            status="fail_open",
            reason=self.reason,
        )
        if result is None:
            return out
        lexical = result.tier == "lexical"
        out.status = "unchanged" if result.tier == "none" else "optimized_lexical" if lexical else "optimized"
        out.tier = result.tier if result.tier in ("model", "lexical") else "none"
        out.tokens_before, out.tokens_after, out.timings = result.tokens_before, result.tokens_after, result.timings
        return out


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
            req = await off_loop(size, lambda: _read(data))
            config = req.config or MessagesConfig()
            await self._check(config)
        except RequestError as exc:
            return self._refused(exc)
        ignored = _ignored(data)
        try:
            turns = await off_loop(size, lambda: find_turns(req.messages, headers, s))
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
        budget = config.budget() or (options.budget if options is not None else None) or s.budget
        ordering = config.ordering or (options.ordering if options is not None else None) or s.options.ordering
        language = config.language or (options.language if options is not None else None)
        namespace = request_namespace(s, headers)
        contexts = [
            _Context(
                t, Job(t.plan.query or "", docs, budget, ordering, language, config.target, config.tier, namespace)
            )
            for t, docs in zip(ready, documents, strict=True)
        ]
        try:
            await self._run(contexts)
        except Overloaded as exc:  # --on-overload reject, and no lexical tier
            self.state.metrics.compress_outcome("overloaded")
            return overloaded_response(exc, s.time_budget_ms)
        for c in contexts:
            await self._write(c, req.model, size)
        status, reason = _status(contexts)
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

    async def _run(self, contexts: list[_Context]) -> None:
        """Optimize every context at once (the engine's pool and micro-batching share them); raises
        :class:`~rag_opt.server.errors.Overloaded` when one was refused under ``--on-overload reject``."""
        refused: list[Overloaded] = []

        async def one(c: _Context) -> None:
            try:
                c.attempt = await self.engine.run(c.job)
            except Overloaded as exc:
                refused.append(exc)

        async with anyio.create_task_group() as tg:
            for c in contexts:
                tg.start_soon(one, c)
        if refused:
            raise refused[0]

    async def _write(self, c: _Context, model: str | None, size: int) -> None:
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
        contexts: list[_Context],
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
        messages = list(req.messages)
        changed: list[int] = []
        before = after = 0
        stats: list[ContextStats] = []
        warnings: list[str] = []
        tiers: set[str] = set()
        hits: list[tuple[int | None, int | None]] = []
        encoding: Literal["parallel", "joint"] | None = None
        target: str | None = config.target
        for c in contexts:
            stats.append(c.stats())
            result = c.attempt.result if c.attempt is not None else None
            if c.written is None or result is None:
                continue
            for i, message in c.written.items():
                messages[i] = message
                changed.append(i)
            before, after = before + result.tokens_before, after + result.tokens_after
            warnings += result.warnings
            target = target or result.target_tokenizer
            if result.tier in ("model", "lexical"):
                tiers.add(result.tier)
            if result.tier == "model" and result.encoding is not None:
                encoding = encoding or result.encoding
                if s.expose_cache_hits and result.encoding == "parallel":
                    hits.append((result.cache_hits, result.cache_misses))
        language = config.language or getattr(self.state.optimizer, "language", None) or s.options.language
        tier: Literal["model", "lexical", "mixed", "none"] = (
            "mixed" if len(tiers) > 1 else "model" if "model" in tiers else "lexical" if tiers else "none"
        )
        counted = [h for h in hits if h[0] is not None and h[1] is not None]
        answer = MessagesStats(
            status=status,
            reason=reason,
            tier=tier,
            messages_changed=sorted(changed),
            contexts=stats,
            target_tokenizer=target,
            ordering=contexts[0].job.ordering if contexts else config.ordering or s.options.ordering,
            language=language,
            encoding=encoding,
            cache_hits=sum(h[0] or 0 for h in counted) if counted else None,
            cache_misses=sum(h[1] or 0 for h in counted) if counted else None,
            total_ms=(time.perf_counter() - t0) * 1e3,
            warnings=warnings,
            ignored=ignored,
        )
        top = {
            "tokens_before": before,
            "tokens_after": after,
            "tokens_saved": before - after,
            "compression_ratio": after / before if before else 1.0,
            "stats": answer.model_dump(mode="json"),
        }
        body = await off_loop(size, lambda: dumps({"messages": messages, **top}).encode("utf-8"))
        return Response(body, media_type="application/json")


def _status(contexts: list[_Context]) -> tuple[Status, str | None]:
    """The request's status from its contexts': optimized when any was, else what the rest came to."""
    done = [c.stats() for c in contexts]
    failed = [d for d in done if d.status == "fail_open"]
    kinds = {d.status for d in done} - {"fail_open"}
    if not kinds:
        return "fail_open", failed[0].reason
    status: Status = (
        "optimized" if "optimized" in kinds else "optimized_lexical" if "optimized_lexical" in kinds else "unchanged"
    )
    if failed:
        return status, f"{len(failed)} of {len(done)} contexts not optimized: {failed[0].reason}"
    lexical = [d.reason for d in done if d.status == "optimized_lexical" and d.reason]
    return status, lexical[0] if lexical else None
