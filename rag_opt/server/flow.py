"""The flow of every optimized route: validate, find the context, optimize it on the worker pool, write it back
in place, forward the request upstream. A route (:mod:`rag_opt.server.chat`, :mod:`rag_opt.server.anthropic_messages`,
:mod:`rag_opt.server.responses`) gives its :data:`Planner`, which reads its API's body and finds the context,
and the shape of its error answers; everything below is the same for all of them.

When the proxy model cannot take a request (the pool is overloaded, its time budget ran out, the model is
still loading, or the context is over ``--lexical-over-tokens``), the lexical tier optimizes it instead, on a
thread outside the pool (``x-ragopt-status: optimized-lexical``), unless it is turned off or the ordering needs
the proxy model. Optimizations queued together with the same settings run as one ``optimize_batch`` call
(:mod:`rag_opt.server.pool`).

The flow never fails a request the optimizer could not help: a failure to find the context, an optimizer error,
an exceeded time budget, an overloaded pool (with ``--on-overload fail-open``, the default), a context over the
work limits or a proxy model that failed to load all forward the request unoptimized (fail-open). Only an
invalid request is answered locally (a 4xx in the route's error shape), and an overloaded pool with
``--on-overload reject`` (a 429 with ``Retry-After``). What happened is told by the ``x-ragopt-*`` response
headers (:class:`Outcome`) and counted in the metrics.

Work is bounded before it is queued and while it runs: more than ``--max-documents`` documents are never queued;
in the worker, :mod:`rag_opt.work` stops the optimization after segmentation past ``--max-units`` units and
before the proxy model runs past ``--max-proxy-tokens`` of its tokens, and between stages and forward passes
once the request's time budget ran out or its client left. A body sent with ``Content-Encoding: gzip`` or
``deflate`` is decoded (at most ``--max-body-bytes`` once decoded) and forwarded decoded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response

from rag_opt.errors import WorkLimitExceeded
from rag_opt.models.threads import available_cores
from rag_opt.server.documents import ContextPlan
from rag_opt.server.errors import BudgetExceeded, ErrorFormat, Overloaded, RequestError, error_response
from rag_opt.server.pool import off_loop, retry_after_s
from rag_opt.server.request import decode_body
from rag_opt.server.security import body_for_log, body_log
from rag_opt.server.settings import ProxySettings
from rag_opt.server.state import ProxyState
from rag_opt.work import WorkLimits, scope

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = ["MODEL_ORDERINGS", "ContextFlow", "Outcome", "Planner"]

logger = logging.getLogger(__name__)

MODEL_ORDERINGS = frozenset({"calibrated", "attention_sort"})  # orderings that need the proxy model's attention

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

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [
            (b"x-ragopt-status", self.status.replace("_", "-").encode()),
            (b"x-ragopt-tokens-before", str(self.tokens_before).encode()),
            (b"x-ragopt-tokens-after", str(self.tokens_after).encode()),
            (b"x-ragopt-optimizer-ms", f"{self.optimizer_ms:.1f}".encode()),
        ]
        if self.reason:
            out.append((b"x-ragopt-reason", self.reason.encode()))
        return out


class ContextFlow:
    """The flow of one optimized route of one app (see the module docstring): ``planner`` finds the context,
    ``fmt`` is the shape of rag-opt's own error answers, ``key_header`` the header that carries
    ``--upstream-api-key`` upstream (``authorization``: as a bearer token; ``x-api-key``: as it is)."""

    def __init__(
        self, state: ProxyState, planner: Planner, fmt: ErrorFormat = "openai", key_header: str = "authorization"
    ) -> None:
        self.state = state
        self.planner = planner
        self.fmt: ErrorFormat = fmt
        self.key_header = key_header
        self._lexical_limiter: anyio.CapacityLimiter | None = None  # created on the event loop, on first use

    async def handle(self, request: Request, raw: bytes) -> Response:
        """Answer one request whose body is ``raw``."""
        state = self.state
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
        if state.settings.log_bodies and body != raw:
            body_log.info("forwarded body=%s", body_for_log(body, state.secrets))
        drop = frozenset({"content-encoding"}) if decoded else frozenset()
        return await state.upstream.forward(
            request, body, outcome.headers(), drop, fmt=self.fmt, key_header=self.key_header
        )

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
        if state.optimizer_state == "failed":
            state.metrics.failed_open("unavailable")
            return await self._render(plan, None), Outcome("fail_open", reason="unavailable")
        t0 = time.perf_counter()
        if len(plan.documents) > s.max_documents:  # never queued
            logger.warning(
                "a request has %d context documents, more than --max-documents %d: forwarding it unoptimized",
                len(plan.documents),
                s.max_documents,
            )
            return await self._fail_open(plan, "limit", t0)
        ordering = plan.options.ordering or s.ordering
        lexical = state.lexical_tier and ordering not in MODEL_ORDERINGS  # the lexical tier can serve this
        if lexical and state.optimizer_state == "loading":  # the proxy model is not loaded yet
            return await self._lexical(plan, "loading", t0)
        if lexical and s.lexical_over_tokens is not None and await self._over_size(plan, s.lexical_over_tokens):
            return await self._lexical(plan, "size", t0)
        try:
            result = await self._optimize(plan)
        except Overloaded as exc:
            state.metrics.shed_load(exc.reason)
            if lexical:
                return await self._lexical(plan, "overload", t0)
            if s.on_overload == "reject":
                state.metrics.outcome("overloaded")
                retry = retry_after_s(exc.estimate_s, s.time_budget_ms / 1e3)
                return error_response(
                    429,
                    "rag-opt's optimizer is overloaded; retry later (the proxy runs with --on-overload reject)",
                    "rate_limit_error",
                    "ragopt_overloaded",
                    headers={"retry-after": str(retry)},
                    fmt=self.fmt,
                )
            logger.info("optimizer overloaded (%s); forwarding the request unoptimized", exc.reason)
            return await self._fail_open(plan, "overload", t0, self._no_lexical(ordering))
        except BudgetExceeded as exc:
            state.metrics.timed_out(exc.stage)
            if lexical:
                return await self._lexical(plan, "timeout", t0)
            logger.warning(
                "optimization exceeded the %.0f ms time budget (%s); forwarding the request unoptimized",
                s.time_budget_ms,
                exc.stage,
            )
            return await self._fail_open(plan, "timeout", t0, self._no_lexical(ordering))
        except WorkLimitExceeded as exc:
            logger.warning("%s: forwarding the request unoptimized", exc)
            return await self._fail_open(plan, "limit", t0)
        except Exception as exc:
            logger.warning("optimization failed (%s); forwarding the request unoptimized", state.why(exc))
            return await self._fail_open(plan, "error", t0)
        return await self._written(plan, result, t0)

    def _no_lexical(self, ordering: str) -> str | None:
        """Why the lexical tier did not step in (a note for ``x-ragopt-reason``), or None when it is off."""
        if self.state.lexical_tier and ordering in MODEL_ORDERINGS:
            return f"the lexical tier cannot serve ordering={ordering} (it needs the proxy model)"
        return None

    async def _written(
        self, plan: ContextPlan, result: OptimizeResult, t0: float, reason: str | None = None
    ) -> tuple[bytes, Outcome]:
        """The request body with ``result`` written back, and its outcome (by the tier that scored it)."""
        state = self.state
        ms = (time.perf_counter() - t0) * 1e3
        try:
            body = await off_loop(len(plan.raw), lambda: plan.render(result))
        except Exception as exc:
            logger.warning("writing the optimized context back failed (%s); forwarding unchanged", state.why(exc))
            return await self._fail_open(plan, "error", t0)
        tier = "lexical" if getattr(result, "tier", "model") == "lexical" else "model"
        state.metrics.optimization(
            ms / 1e3, result.tokens_before, result.tokens_after, len(plan.documents), len(result.documents), tier
        )
        status = "optimized_lexical" if tier == "lexical" else "optimized"
        return body, Outcome(
            status, result.tokens_before, result.tokens_after, ms, reason if tier == "lexical" else None
        )

    async def _lexical(self, plan: ContextPlan, reason: str, t0: float) -> tuple[bytes, Outcome]:
        """Optimize with the lexical tier (no model, milliseconds) on a thread, off the event loop and outside the
        model's pool; fail-open if that fails too."""
        state = self.state
        state.metrics.lexical_used(reason)
        budget = plan.options.budget if plan.options.budget is not None else state.settings.budget
        ordering = plan.options.ordering or state.settings.ordering
        query, docs, optimizer = plan.query or "", plan.optimizer_documents(), state.optimizer
        limits = WorkLimits(max_units=state.settings.max_units, max_proxy_tokens=state.settings.max_proxy_tokens)

        def job() -> OptimizeResult:
            with scope(limits=limits):
                return optimizer.optimize(query, docs, ordering=ordering, tier="lexical", **budget.as_kwargs())  # type: ignore[call-arg]

        try:
            if self._lexical_limiter is None:  # as many at once as there are cores: few threads, little memory
                self._lexical_limiter = anyio.CapacityLimiter(available_cores())
            result = await anyio.to_thread.run_sync(job, limiter=self._lexical_limiter)
        except WorkLimitExceeded as exc:
            logger.warning("%s: forwarding the request unoptimized", exc)
            return await self._fail_open(plan, "limit", t0)
        except Exception as exc:
            logger.warning("lexical optimization failed (%s); forwarding the request unoptimized", state.why(exc))
            return await self._fail_open(plan, "error", t0)
        return await self._written(plan, result, t0, reason)

    async def _over_size(self, plan: ContextPlan, limit: int) -> bool:
        """Whether the context has more than ``limit`` target tokens (False when they cannot be counted)."""
        counter = getattr(self.state.optimizer, "counter", None)
        if counter is None:
            return False
        texts = [d.text for d in plan.documents]
        try:
            n = await off_loop(sum(map(len, texts)), lambda: sum(counter.count(t) for t in texts))
        except Exception as exc:  # counting is a hint only
            logger.warning("counting the context's tokens failed (%s)", self.state.why(exc))
            return False
        return bool(n > limit)

    async def _fail_open(
        self, plan: ContextPlan, reason: str, t0: float, note: str | None = None
    ) -> tuple[bytes, Outcome]:
        self.state.metrics.failed_open(reason)
        ms = (time.perf_counter() - t0) * 1e3
        told = f"{reason}; {note}" if note else reason
        return await self._render(plan, None), Outcome("fail_open", optimizer_ms=ms, reason=told)

    async def _render(self, plan: ContextPlan, result: OptimizeResult | None) -> bytes:
        try:
            return await off_loop(len(plan.raw), lambda: plan.render(result))
        except Exception as exc:  # pragma: no cover - last resort: the original bytes
            logger.warning("rewriting the request failed (%s); forwarding the original bytes", self.state.why(exc))
            return plan.raw

    async def _optimize(self, plan: ContextPlan) -> OptimizeResult:
        """Run the optimizer on the pool within the time budget (raises Overloaded / BudgetExceeded / its error)."""
        state = self.state
        budget = plan.options.budget if plan.options.budget is not None else state.settings.budget
        ordering = plan.options.ordering or state.settings.ordering
        query, docs, optimizer = plan.query or "", plan.optimizer_documents(), state.optimizer
        limits = WorkLimits(max_units=state.settings.max_units, max_proxy_tokens=state.settings.max_proxy_tokens)

        kwargs = budget.as_kwargs()
        budget_s = state.settings.time_budget_ms / 1e3

        def job() -> OptimizeResult:
            with scope(limits=limits):
                return optimizer.optimize(query, docs, ordering=ordering, **kwargs)

        def batch(items: list[tuple[str, list[dict[str, Any]]]]) -> list[OptimizeResult]:
            """Several questions with the same settings as one ``optimize_batch`` call (one alone: ``optimize``)."""
            with scope(limits=limits):
                if len(items) == 1:
                    return [optimizer.optimize(items[0][0], items[0][1], ordering=ordering, **kwargs)]
                run = optimizer.optimize_batch  # type: ignore[attr-defined]
                out: list[OptimizeResult] = run(
                    [q for q, _ in items], [d for _, d in items], ordering=ordering, **kwargs
                )
                return out

        state.metrics.add_in_flight(1)
        try:
            if state.batching:
                key = (ordering, tuple(sorted(kwargs.items())))
                return await state.pool.run_batched(key, (query, docs), batch, budget_s)
            return await state.pool.run(job, budget_s)
        finally:
            state.metrics.add_in_flight(-1)
