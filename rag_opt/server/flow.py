"""The flow of every optimized route: validate, find the context, optimize it on the worker pool, write it back
in place, forward the request upstream. A route (:mod:`rag_opt.server.chat`, :mod:`rag_opt.server.anthropic_messages`,
:mod:`rag_opt.server.responses`, :mod:`rag_opt.server.gemini`) gives its :data:`Planner`, which reads its API's
body and finds the context, and the shape of its error answers; everything below is the same for all of them.

Which tier optimizes the context is :class:`rag_opt.server.engine.Engine`'s (shared with ``/v1/compress``): the
proxy model on the worker pool (micro-batched, within the time budget, bounded by ``--max-documents`` and the work
limits), the lexical tier when the model cannot take it, or nothing. The flow never fails a request the optimizer
could not help: a failure to find the context, an optimizer error, an exceeded time budget, an overloaded pool
(with ``--on-overload fail-open``, the default), a context over the work limits or a proxy model that failed to
load all forward the request unoptimized (fail-open). Only an invalid request is answered locally (a 4xx in the
route's error shape), and an overloaded pool with ``--on-overload reject`` (a 429 with ``Retry-After``). What
happened is told by the ``x-ragopt-*`` response headers (:class:`Outcome`; ``x-ragopt-over-budget``: the tokens
kept over the budget, when a unit too large for it was kept whole rather than empty a message) and counted in the
metrics (the per-model totals of ``/stats`` by the request's model: :meth:`ContextFlow.model_of`) and, with
``--otel``, recorded as an OpenTelemetry span (:mod:`rag_opt.telemetry`). When the
proxy model read the context, ``x-ragopt-encoding`` says how, and under parallel encoding, when the operator
turns them on (``--expose-cache-hits``: they tell a client whether anyone sent a document recently),
``x-ragopt-cache-hits`` / ``x-ragopt-cache-misses`` how many document blocks came from the encoding cache and how
many this request encoded. The encoding cache is read in the request's tenant namespace (``--cache-namespace``,
:func:`rag_opt.server.tenancy.request_namespace`).

Per-request options (budget, ordering, ``language``, placement) come from the ``x-ragopt-*`` headers and the
``rag_opt`` field on every route (:mod:`rag_opt.server.request`). A body sent with ``Content-Encoding: gzip`` or
``deflate`` is decoded (at most ``--max-body-bytes`` once decoded) and forwarded decoded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from rag_opt.server.documents import ContextPlan
from rag_opt.server.engine import MODEL_ORDERINGS, Attempt, Engine, Job, overloaded_response
from rag_opt.server.errors import ErrorFormat, Overloaded, RequestError, error_response
from rag_opt.server.paths import is_gemini_path
from rag_opt.server.pool import off_loop
from rag_opt.server.request import decode_body
from rag_opt.server.security import body_for_log, body_log
from rag_opt.server.settings import ProxySettings
from rag_opt.server.state import ProxyState
from rag_opt.server.tenancy import request_namespace

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = ["MODEL_ORDERINGS", "ContextFlow", "Outcome", "Planner"]

logger = logging.getLogger(__name__)

Planner = Callable[[bytes, Mapping[str, str], ProxySettings], ContextPlan]
"""Reads one API's request body (raw bytes, request headers, the proxy's settings) and finds its context;
raises :class:`~rag_opt.server.errors.RequestError` for an invalid request."""


@dataclass
class Outcome:
    """What rag-opt did with one request; becomes the ``x-ragopt-*`` response headers."""

    status: str
    tokens_before: int = 0
    tokens_after: int = 0
    optimizer_ms: float = 0.0
    reason: str | None = None  # why it failed open, or why the lexical tier ran
    encoding: str | None = None  # how the proxy model read the context (the model tier only)
    # parallel encoding: document blocks from the encoding cache / encoded now (the proxy sets them only with
    # --expose-cache-hits)
    cache_hits: int | None = None
    cache_misses: int | None = None
    over_budget: int = 0  # tokens kept over the budget (a unit kept whole rather than empty the context)
    result: OptimizeResult | None = field(default=None, repr=False)  # what the optimizer answered (for the span)

    def read_by_model(self, result: OptimizeResult, counters: bool = True) -> Outcome:
        """Record how the proxy model read ``result``'s context: its encoding and, under parallel encoding with
        ``counters``, the request's cache hits and misses (nothing when another tier scored or nothing was read;
        the proxy passes ``--expose-cache-hits``)."""
        if result.tier == "model" and result.encoding is not None:
            self.encoding = result.encoding
            if counters and result.encoding == "parallel":
                self.cache_hits, self.cache_misses = result.cache_hits, result.cache_misses
        return self

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [
            (b"x-ragopt-status", self.status.encode()),  # spelled as in /v1/compress bodies and metrics
            (b"x-ragopt-tokens-before", str(self.tokens_before).encode()),
            (b"x-ragopt-tokens-after", str(self.tokens_after).encode()),
            (b"x-ragopt-optimizer-ms", f"{self.optimizer_ms:.1f}".encode()),
        ]
        if self.reason:
            out.append((b"x-ragopt-reason", self.reason.encode()))
        if self.over_budget:
            out.append((b"x-ragopt-over-budget", str(self.over_budget).encode()))
        if self.encoding is not None:
            out.append((b"x-ragopt-encoding", self.encoding.encode()))
        if self.cache_hits is not None and self.cache_misses is not None:
            out.append((b"x-ragopt-cache-hits", str(self.cache_hits).encode()))
            out.append((b"x-ragopt-cache-misses", str(self.cache_misses).encode()))
        return out


class ContextFlow:
    """The flow of one optimized route of one app (see the module docstring): ``planner`` finds the context,
    ``fmt`` is the shape of rag-opt's own error answers, ``key_header`` the header that carries
    ``--upstream-api-key`` upstream (``authorization``: as a bearer token; ``x-api-key``: as it is), ``engine``
    the app's optimization tiers (shared by its routes; default: a new one)."""

    def __init__(
        self,
        state: ProxyState,
        planner: Planner,
        fmt: ErrorFormat = "openai",
        key_header: str = "authorization",
        engine: Engine | None = None,
    ) -> None:
        self.state = state
        self.planner = planner
        self.fmt: ErrorFormat = fmt
        self.key_header = key_header
        self.engine = engine if engine is not None else Engine(state)

    async def handle(self, request: Request, raw: bytes) -> Response:
        """Answer one request whose body is ``raw``."""
        state = self.state
        t0 = time.perf_counter()
        encoding = request.headers.get("content-encoding", "")
        decoded = encoding.strip().lower() not in ("", "identity")
        if decoded:
            limit = state.settings.max_body_bytes
            try:
                raw = await off_loop(len(raw), lambda: decode_body(raw, encoding, limit))
            except RequestError as exc:
                return self._refused(exc)
        prepared = await self._prepare(raw, request)
        if isinstance(prepared, Response):
            return prepared
        body, outcome = prepared
        state.metrics.outcome(outcome.status)
        path = request.scope["path"]  # --otel: the request's span, with its outcome
        state.tracing.record(request.headers, outcome.status, outcome.reason, outcome.result, t0, path)
        if state.settings.log_bodies and body != raw:
            body_log.info("forwarded body=%s", body_for_log(body, state.secrets))
        drop = frozenset({"content-encoding"}) if decoded else frozenset()
        return await state.upstream.forward(
            request, body, outcome.headers(), drop, fmt=self.fmt, key_header=self.key_header
        )

    def model_of(self, request: Request, plan: ContextPlan) -> str | None:
        """The request's model, for the per-model totals of ``/stats``: the body's ``model`` (a route whose API
        names it elsewhere, e.g. in the path, says so here)."""
        model = plan.body.get("model")
        return model if isinstance(model, str) else None

    def namespace(self, request: Request) -> str | None:
        """The request's encoding cache namespace (``--cache-namespace``; the ``key`` query parameter is a
        credential on the Gemini API's paths)."""
        query = request.scope.get("query_string", b"") if is_gemini_path(request.scope["path"]) else None
        return request_namespace(self.state.settings, request.headers, query)

    def _refused(self, exc: RequestError) -> Response:
        """The answer to an invalid request (not forwarded), in the route's error shape."""
        self.state.metrics.outcome("rejected")
        self.state.metrics.local_error("too_large" if exc.status == 413 else "invalid_request")
        return error_response(exc.status, exc.message, "invalid_request_error", exc.code, exc.param, fmt=self.fmt)

    async def _prepare(self, raw: bytes, request: Request) -> tuple[bytes, Outcome] | Response:
        """The body to forward and what was done, or a local answer (400, 429)."""
        state, s = self.state, self.state.settings
        headers, planner = request.headers, self.planner
        try:
            plan = await off_loop(len(raw), lambda: planner(raw, headers, s))
        except RequestError as exc:
            return self._refused(exc)
        except Exception as exc:  # a bug here must not reach the client
            logger.warning("finding context failed (%s); forwarding the request unchanged", state.why(exc))
            state.metrics.failed_open("error")
            return raw, Outcome("fail_open", reason="error")
        if not plan.options.enabled:
            return await self._render(plan, None), Outcome("disabled")
        if not plan.documents:
            return await self._render(plan, None), Outcome("no_context")
        if plan.query is None:
            return await self._render(plan, None), Outcome("no_query")
        options = plan.options
        documents = await off_loop(len(plan.raw), plan.optimizer_documents)  # (one per document: off the loop)
        job = Job(
            plan.query,
            documents,
            options.budget if options.budget is not None else s.budget,
            options.ordering or s.options.ordering,
            language=options.language,
            namespace=self.namespace(request),
        )
        try:
            attempt = await self.engine.run(job)
        except Overloaded as exc:  # --on-overload reject, and no lexical tier
            state.metrics.outcome("overloaded")
            return overloaded_response(exc, s.time_budget_ms, self.fmt)
        if attempt.result is None:
            return await self._unoptimized(plan, attempt)
        return await self._written(plan, attempt, self.model_of(request, plan))

    async def _written(self, plan: ContextPlan, attempt: Attempt, model: str | None) -> tuple[bytes, Outcome]:
        """The request body with the result written back, and its outcome (by the tier that scored it)."""
        state, result = self.state, attempt.result
        assert result is not None
        try:
            body = await off_loop(len(plan.raw), lambda: plan.render(result))
        except Exception as exc:
            logger.warning("writing the optimized context back failed (%s); forwarding unchanged", state.why(exc))
            return await self._unoptimized(plan, self.engine.failed("error", attempt.t0))
        ms = self.engine.record(attempt, len(plan.documents), model)
        lexical = attempt.tier == "lexical"
        status = "optimized_lexical" if lexical else "optimized"
        outcome = Outcome(status, result.tokens_before, result.tokens_after, ms, attempt.reason if lexical else None)
        outcome.over_budget = result.over_budget
        outcome.result = result
        return body, outcome if lexical else outcome.read_by_model(result, state.settings.expose_cache_hits)

    async def _unoptimized(self, plan: ContextPlan, attempt: Attempt) -> tuple[bytes, Outcome]:
        """The request to forward unoptimized (fail-open; counted by the engine) and its outcome."""
        return await self._render(plan, None), Outcome(
            "fail_open", optimizer_ms=attempt.elapsed_ms(), reason=attempt.told
        )

    async def _render(self, plan: ContextPlan, result: OptimizeResult | None) -> bytes:
        try:
            return await off_loop(len(plan.raw), lambda: plan.render(result))
        except Exception as exc:  # pragma: no cover - last resort: the original bytes
            logger.warning("rewriting the request failed (%s); forwarding the original bytes", self.state.why(exc))
            return plan.raw
