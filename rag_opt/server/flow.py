"""The flow of every optimized route: decode the body, rewrite it with the transport-free core, forward it upstream.
A route (:mod:`rag_opt.server.routes`: chat completions, Anthropic messages, OpenAI responses, Gemini) gives its
API's planner (:mod:`rag_opt.wire`: the chat, Responses, Anthropic and Gemini planners read the body and find the
context) and the shape of its error answers; everything below is the same for all of them. Reading the body,
building the job, writing the result back and the outcome are :class:`rag_opt.wire.flow.RequestFlow`'s, which the
gateway adapter runs too: this module is its HTTP side (vLLM's split of ``serving`` from the API router).

Which tier optimizes the context is :class:`rag_opt.server.engine.Engine`'s (shared with ``/v1/compress``): the
proxy model on the worker pool (micro-batched, within the time budget, bounded by ``--max-documents`` and the work
limits), the lexical tier when the model cannot take it, or nothing. The flow never fails a request the optimizer
could not help: a failure to find the context, an optimizer error, an exceeded time budget, an overloaded pool
(with ``--on-overload fail-open``, the default), a context over the work limits or a proxy model that failed to
load all forward the request unoptimized (fail-open). Only an invalid request is answered locally (a 4xx in the
route's error shape), and an overloaded pool with ``--on-overload reject`` (a 429 with ``Retry-After``). What
happened is told by the ``x-ragopt-*`` response headers (:class:`~rag_opt.wire.flow.Outcome`;
``x-ragopt-over-budget``: the tokens kept over the budget, when a unit too large for it was kept whole rather than
empty a message) and counted in the metrics (the per-model totals of ``/stats`` by the request's model:
:meth:`ContextFlow.model_of`) and, with ``--otel``, recorded as an OpenTelemetry span (:mod:`rag_opt.telemetry`).
When the proxy model read the context, ``x-ragopt-encoding`` says how, and under parallel encoding, when the
operator turns them on (``--expose-cache-hits``: they tell a client whether anyone sent a document recently),
``x-ragopt-cache-hits`` / ``x-ragopt-cache-misses`` how many document blocks came from the encoding cache and how
many this request encoded. The encoding cache is read in the request's tenant namespace (``--cache-namespace``,
:func:`rag_opt.server.tenancy.request_namespace`).

Per-request options (budget, ordering, ``language``, placement) come from the ``x-ragopt-*`` headers and the
``rag_opt`` field on every route (:mod:`rag_opt.wire.request`). A body sent with ``Content-Encoding: gzip`` or
``deflate`` is decoded (at most ``--max-body-bytes`` once decoded) and forwarded decoded.
"""

from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.responses import Response

from rag_opt.server.engine import Engine, overloaded_response
from rag_opt.server.errors import ErrorFormat, Overloaded, error_response
from rag_opt.server.paths import is_gemini_path
from rag_opt.server.security import body_for_log, body_log
from rag_opt.server.state import ProxyState
from rag_opt.server.tenancy import request_namespace
from rag_opt.wire.documents import ContextPlan
from rag_opt.wire.errors import RequestError
from rag_opt.wire.flow import Planner, RequestFlow
from rag_opt.wire.job import Attempt, Job
from rag_opt.wire.offload import off_loop
from rag_opt.wire.request import decode_body

__all__ = ["ContextFlow"]

logger = logging.getLogger(__name__)


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
        self.rewrite = RequestFlow(planner, state.settings.wire)

    async def handle(self, request: Request, raw: bytes) -> Response:
        """Answer one request whose body is ``raw``."""
        state = self.state
        t0 = time.perf_counter()
        encoding = request.headers.get("content-encoding", "")
        decoded = encoding.strip().lower() not in ("", "identity")
        try:
            if decoded:
                limit = state.settings.max_body_bytes
                raw = await off_loop(len(raw), lambda: decode_body(raw, encoding, limit))
            rewritten = await self.rewrite.apply(raw, request.headers, _Backend(self, request), self.namespace(request))
        except RequestError as exc:
            return self._refused(exc)
        except Overloaded as exc:  # --on-overload reject, and no lexical tier
            state.metrics.outcome("overloaded")
            return overloaded_response(exc, state.settings.time_budget_ms, self.fmt)
        body, outcome = rewritten.body, rewritten.outcome
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


class _Backend:
    """The app's engine as the core's backend for one request (:class:`rag_opt.wire.flow.Backend`): its tiers, its
    metrics, and the server's fail-open logging."""

    def __init__(self, flow: ContextFlow, request: Request) -> None:
        self.flow, self.request = flow, request
        self.state, self.engine = flow.state, flow.engine

    async def run(self, job: Job) -> Attempt:
        return await self.engine.run(job)

    def record(self, attempt: Attempt, plan: ContextPlan) -> float:
        return self.engine.record(attempt, len(plan.documents), self.flow.model_of(self.request, plan))

    def unreadable(self, exc: Exception) -> str:
        logger.warning("finding context failed (%s); forwarding the request unchanged", self.state.why(exc))
        self.state.metrics.failed_open("error")
        return "error"

    def unwritable(self, exc: Exception, attempt: Attempt) -> Attempt:
        logger.warning("writing the optimized context back failed (%s); forwarding unchanged", self.state.why(exc))
        return self.engine.failed("error", attempt.t0)

    def unrendered(self, exc: Exception) -> None:
        logger.warning("rewriting the request failed (%s); forwarding the original bytes", self.state.why(exc))
