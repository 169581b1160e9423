"""One optimization for a route, by the tier that can take it: the proxy model on the worker pool (micro-batched,
within the time budget), the lexical tier when the model cannot take it, or nothing (fail-open).

Every route that optimizes context (chat completions, Anthropic messages and OpenAI responses through
:class:`~rag_opt.server.flow.ContextFlow`, and ``/v1/compress``) goes through :meth:`Engine.run` of the app's one
engine, so they share the pool, the lexical tier, the work limits and the metrics. The engine only decides which tier
runs and translates the pool's answers; what to do with the result (write it back into a request, answer it as
JSON) is the route's.

The decisions, in order: more than ``--max-documents`` documents fail open without being queued (``limit``), on
every tier; a job that asks for the lexical tier runs on it; a proxy model that failed to load fails open
(``unavailable``); with the lexical tier available (on, the optimizer has one, the ordering does not need the proxy
model's attention) it runs instead of the model while the model is loading (``loading``) or for a context over
``--lexical-over-tokens`` (``size``), and when the pool does not admit the job (``overload``) or its time budget
runs out (``timeout``). Without it, an overload fails open, or raises :class:`~rag_opt.server.errors.Overloaded`
with ``--on-overload reject`` (the route answers 429); a timeout, an error or a context over the work limits
(``--max-question-tokens``, ``--max-units``, ``--max-proxy-tokens``) fail open.

The lexical tier has the same limits as the model and what is left of the request's time budget (at least a twentieth
of it: one budget per request, answered within 1.1 budgets: :func:`lexical_budget_s`), on a pool of its own
(:attr:`~rag_opt.server.state.ProxyState.lexical_pool`: a worker per core, ``--max-lexical-queue`` waiting): a
job it does not admit or that runs out of budget fails open (``overload``, ``timeout``), or, when it asked for the
lexical tier, raises :class:`~rag_opt.server.errors.Overloaded` under ``--on-overload reject``.

A job (:class:`rag_opt.wire.job.Job`) carries its tenant's encoding cache namespace (``Job.namespace``, from
``--cache-namespace``): the model tier reads and writes the cache in it, and jobs of two namespaces never share a
micro-batch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from rag_opt.errors import WorkLimitExceeded
from rag_opt.models.encoding_cache import cache_namespace
from rag_opt.server.errors import BudgetExceeded, ErrorFormat, Overloaded, error_response
from rag_opt.server.pool import retry_after_s
from rag_opt.server.state import ProxyState
from rag_opt.telemetry import untraced  # the server records its own span per request (--otel)
from rag_opt.wire.job import Attempt, Job
from rag_opt.wire.offload import off_loop
from rag_opt.work import WorkLimits, scope

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = ["LEXICAL_FLOOR", "MODEL_ORDERINGS", "Engine", "lexical_budget_s", "overloaded_response"]

logger = logging.getLogger(__name__)

MODEL_ORDERINGS = frozenset({"calibrated", "attention_sort"})  # orderings that need the proxy model's attention


def overloaded_response(exc: Overloaded, time_budget_ms: float, fmt: ErrorFormat = "openai") -> Response:
    """The 429 (with ``Retry-After``) for a job not admitted under ``--on-overload reject``, in the route's error
    shape ``fmt``."""
    retry = retry_after_s(exc.estimate_s, time_budget_ms / 1e3)
    return error_response(
        429,
        "rag-opt's optimizer is overloaded; retry later (the proxy runs with --on-overload reject)",
        "rate_limit_error",
        "ragopt_overloaded",
        headers={"retry-after": str(retry)},
        fmt=fmt,
    )


LEXICAL_FLOOR = 0.05  # the lexical tier's time when the request's budget is spent: this share of the budget


def lexical_budget_s(budget_s: float, t0: float, now: float | None = None) -> float:
    """What is left of a request's time budget ``budget_s`` since ``t0`` (``time.perf_counter()``) for the lexical
    tier: one budget per request, not a fresh one after the model spent it. At least :data:`LEXICAL_FLOOR` of the
    budget (the lexical tier takes milliseconds), so a request is answered within 1.1 budgets (1.05 and the
    response's own time)."""
    elapsed = (time.perf_counter() if now is None else now) - t0
    return max(budget_s - elapsed, LEXICAL_FLOOR * budget_s)


class Engine:
    """The optimization tiers of one app (see the module docstring)."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def lexical_available(self, ordering: str) -> bool:
        """Whether the lexical tier can serve ``ordering`` here."""
        return self.state.lexical_tier and ordering not in MODEL_ORDERINGS

    def no_lexical_note(self, ordering: str) -> str | None:
        """Why the lexical tier did not step in (a note for the reason), or None when it is off."""
        if self.state.lexical_tier and ordering in MODEL_ORDERINGS:
            return f"the lexical tier cannot serve ordering={ordering} (it needs the proxy model)"
        return None

    def record(self, attempt: Attempt, documents_before: int, model: str | None) -> float:
        """Count a finished optimization in the metrics; returns its milliseconds so far."""
        result = attempt.result
        assert result is not None
        ms = attempt.elapsed_ms()
        self.state.metrics.optimization(
            ms / 1e3,
            result.tokens_before,
            result.tokens_after,
            documents_before,
            len(result.documents),
            attempt.tier,
            model=model,
        )
        return ms

    def failed(self, reason: str, t0: float, note: str | None = None) -> Attempt:
        """A fail-open outcome, counted (``ragopt_fail_open_total{reason}``)."""
        self.state.metrics.failed_open(reason)
        return Attempt(None, t0, reason, note)

    async def run(self, job: Job) -> Attempt:
        """Optimize ``job`` by the tier that can take it; never raises but
        :class:`~rag_opt.server.errors.Overloaded` (with ``--on-overload reject``: no lexical tier, or a job that
        asked for it and that it did not admit)."""
        state, s = self.state, self.state.settings
        t0 = time.perf_counter()
        if len(job.documents) > s.max_documents:  # never queued, on any tier
            logger.warning(
                "a request has %d context documents, more than --max-documents %d: not optimizing it",
                len(job.documents),
                s.max_documents,
            )
            return self.failed("limit", t0)
        if job.tier == "lexical":
            return await self._lexical(job, None, t0)
        if state.optimizer_state == "failed":
            return self.failed("unavailable", t0)
        lexical = job.tier == "auto" and self.lexical_available(job.ordering)
        if lexical and state.optimizer_state == "loading":  # the proxy model is not loaded yet
            return await self._lexical(job, "loading", t0)
        if lexical and s.lexical_over_tokens is not None and await self._over_size(job, s.lexical_over_tokens):
            return await self._lexical(job, "size", t0)
        try:
            result = await self._optimize(job)
        except Overloaded as exc:
            state.metrics.shed_load(exc.reason)
            if lexical:
                return await self._lexical(job, "overload", t0)
            if s.on_overload == "reject":
                raise
            logger.info("optimizer overloaded (%s); not optimizing the request", exc.reason)
            return self.failed("overload", t0, self.no_lexical_note(job.ordering))
        except BudgetExceeded as exc:
            state.metrics.timed_out(exc.stage)
            if lexical:
                return await self._lexical(job, "timeout", t0)
            logger.warning(
                "optimization exceeded the %.0f ms time budget (%s); not optimizing the request",
                s.time_budget_ms,
                exc.stage,
            )
            return self.failed("timeout", t0, self.no_lexical_note(job.ordering))
        except Exception as exc:
            return self._gave_up(exc, t0, "optimization")
        return Attempt(result, t0)

    def _gave_up(self, exc: Exception, t0: float, what: str) -> Attempt:
        """The fail-open outcome of a run that raised ``exc``: ``limit`` past the work limits, else ``error``."""
        if isinstance(exc, WorkLimitExceeded):
            logger.warning("%s: not optimizing the request", exc)
            return self.failed("limit", t0)
        logger.warning("%s failed (%s); not optimizing the request", what, self.state.why(exc))
        return self.failed("error", t0)

    def _limits(self) -> WorkLimits:
        s = self.state.settings
        return WorkLimits(
            max_units=s.max_units, max_proxy_tokens=s.max_proxy_tokens, max_question_tokens=s.max_question_tokens
        )

    async def _lexical(self, job: Job, reason: str | None, t0: float) -> Attempt:
        """Optimize with the lexical tier (no model, milliseconds) on its own pool, off the event loop, with the
        model's work limits and time budget; fail-open if that fails too (see the module docstring). ``reason``:
        why it runs instead of the model (None: asked for)."""
        state = self.state
        if reason is not None:
            state.metrics.lexical_used(reason)
        optimizer, limits, settings = state.optimizer, self._limits(), job.settings()

        def work() -> OptimizeResult:
            with scope(limits=limits, progress=False), untraced():
                return optimizer.optimize(job.query, job.documents, tier="lexical", **settings)  # type: ignore[call-arg]

        try:
            result = await state.lexical_pool.run(work, lexical_budget_s(state.settings.time_budget_ms / 1e3, t0))
        except Overloaded as exc:
            state.metrics.shed_load(exc.reason)
            if reason is None and state.settings.on_overload == "reject":
                raise
            logger.info("lexical tier overloaded (%s); not optimizing the request", exc.reason)
            return self.failed("overload", t0, None if reason is None else "the lexical tier is overloaded too")
        except BudgetExceeded as exc:
            state.metrics.timed_out(exc.stage)
            logger.warning(
                "lexical optimization exceeded the %.0f ms time budget (%s); not optimizing the request",
                state.settings.time_budget_ms,
                exc.stage,
            )
            return self.failed("timeout", t0, None if reason is None else "the lexical tier ran out of time too")
        except Exception as exc:
            return self._gave_up(exc, t0, "lexical optimization")
        return Attempt(result, t0, reason)

    async def _over_size(self, job: Job, limit: int) -> bool:
        """Whether the context has more than ``limit`` target tokens (False when they cannot be counted)."""
        counter = getattr(self.state.optimizer, "counter", None)
        documents = job.documents
        try:
            if job.target is not None and counter is not None:
                from rag_opt.text.tokens import get_token_counter

                counter = get_token_counter(job.target)
            if counter is None:
                return False
            count = counter.count
            size = sum(len(str(d.get("text", ""))) for d in documents)  # (at most --max-documents of them)
            n = await off_loop(size, lambda: sum(count(str(d.get("text", ""))) for d in documents))
        except Exception as exc:  # counting is a hint only
            logger.warning("counting the context's tokens failed (%s)", self.state.why(exc))
            return False
        return bool(n > limit)

    async def _optimize(self, job: Job) -> OptimizeResult:
        """Run the optimizer on the pool within the time budget (raises Overloaded / BudgetExceeded / its error).

        The encoding cache is read and written in the job's namespace (set in the worker thread that runs the
        optimizer), and only jobs of one namespace share a micro-batch: a tenant's documents are never another's
        cache hits."""
        state = self.state
        optimizer, limits, settings = state.optimizer, self._limits(), job.settings()
        budget_s = state.settings.time_budget_ms / 1e3
        namespace = job.namespace

        def one() -> OptimizeResult:
            with cache_namespace(namespace), scope(limits=limits, progress=False), untraced():
                return optimizer.optimize(job.query, job.documents, **settings)

        def batch(items: list[tuple[str, list[dict[str, Any]]]]) -> list[OptimizeResult]:
            """Several questions with the same settings as one ``optimize_batch`` call (one alone: ``optimize``),
            all of one namespace (it is part of the batch's key)."""
            with cache_namespace(namespace), scope(limits=limits, progress=False), untraced():
                if len(items) == 1:
                    return [optimizer.optimize(items[0][0], items[0][1], **settings)]
                run = optimizer.optimize_batch  # type: ignore[attr-defined]
                out: list[OptimizeResult] = run([q for q, _ in items], [d for _, d in items], **settings)
                return out

        state.metrics.add_in_flight(1)
        try:
            if state.batching:
                key = (namespace or "", tuple(sorted(settings.items())))
                return await state.pool.run_batched(key, (job.query, job.documents), batch, budget_s)
            return await state.pool.run(one, budget_s)
        finally:
            state.metrics.add_in_flight(-1)
