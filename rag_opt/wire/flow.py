"""Applying an optimization to one request body, without a transport: read the body with its API's
:data:`Planner`, find the context, optimize it through a :class:`Backend`, write it back in place; what happened is
an :class:`Outcome` (the ``x-ragopt-*`` response headers).

As vLLM keeps its OpenAI ``protocol`` and ``serving`` classes apart from the API router that calls them, this is
the serving side of rag-opt's request rewriting. Two surfaces drive it:

- ``rag-opt serve``: :class:`rag_opt.server.flow.ContextFlow` decodes a request's ``Content-Encoding``, runs
  :meth:`RequestFlow.apply` with the app's engine as the backend (the worker pool, micro-batching, the lexical
  tier, the metrics) and forwards the new body upstream (a :class:`~rag_opt.wire.errors.RequestError`: a 4xx in
  the route's error shape);
- a gateway adapter: :class:`rag_opt.adapters.gateway.RequestOptimizer` runs it with an in-process optimizer or a
  sidecar as the backend and hands the gateway the new messages (a ``RequestError``: a ``GatewayError``).

Each passes its own :class:`~rag_opt.wire.settings.WireSettings` (derived from its configuration); neither builds
the other's.

The steps, the same for both: the planner reads the body (an invalid request raises
:class:`~rag_opt.wire.errors.RequestError`; any other failure to read it is not the client's fault: the body goes on
as sent, ``fail_open``, with the reason :meth:`Backend.unreadable` gives). A request with ``x-ragopt-disable``
(``disabled``), without context (``no_context``) or without a question (``no_query``) goes on unoptimized, its
``rag_opt`` field removed. Otherwise its :class:`~rag_opt.wire.job.Job` (the request's options over the settings)
runs on the backend; without a result the request goes on unoptimized (``fail_open``, the attempt's reason); with
one, the result is written back (a failure to write it is :meth:`Backend.unwritable`'s to decide) and counted
(:meth:`Backend.record`), and the outcome is ``optimized`` or ``optimized_lexical`` with the tokens before and
after. Nothing is scored, selected or ordered here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rag_opt.wire.documents import ContextPlan
from rag_opt.wire.errors import RequestError
from rag_opt.wire.job import Attempt, Job
from rag_opt.wire.offload import off_loop
from rag_opt.wire.settings import WireSettings

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = ["Backend", "Outcome", "Planner", "RequestFlow", "Rewritten"]

Planner = Callable[[bytes, Mapping[str, str], WireSettings], ContextPlan]
"""Reads one API's request body (raw bytes, request headers, the core's settings) and finds its context;
raises :class:`~rag_opt.wire.errors.RequestError` for an invalid request."""


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


class Backend(Protocol):
    """Where a request's job is optimized, and what each failure costs there: the server's engine and metrics, or
    a gateway's in-process optimizer or sidecar (its fail-open or fail-closed policy)."""

    async def run(self, job: Job) -> Attempt:
        """Optimize ``job``: an attempt with its result, or without one (a counted fail-open, with its reason).
        Raises only what its surface answers itself (the server's ``Overloaded`` under ``--on-overload reject``,
        a gateway's refusal when it fails closed)."""
        ...

    def record(self, attempt: Attempt, plan: ContextPlan) -> float:
        """Count ``attempt``'s result, written back into ``plan``'s body; its milliseconds since it began."""
        ...

    def unreadable(self, exc: Exception) -> str:
        """The planner failed on a body with ``exc`` (not a :class:`~rag_opt.wire.errors.RequestError`: not the
        client's fault): log and count it; the reason of the fail-open outcome (or raise to refuse the request)."""
        ...

    def unwritable(self, exc: Exception, attempt: Attempt) -> Attempt:
        """Writing ``attempt``'s result back failed with ``exc``: the counted fail-open attempt to go on with
        unoptimized (or raise)."""
        ...

    def unrendered(self, exc: Exception) -> None:
        """Writing the request back unoptimized (its ``rag_opt`` field removed) failed with ``exc``: log it, and
        the original bytes go on (or raise)."""
        ...


@dataclass(frozen=True)
class Rewritten:
    """The body to send on (the raw bytes, the same object, when nothing changed) and what was done."""

    body: bytes
    outcome: Outcome


class RequestFlow:
    """One API's request rewriting (see the module docstring): ``planner`` reads its bodies, ``settings`` are
    the surface's."""

    def __init__(self, planner: Planner, settings: WireSettings) -> None:
        self.planner = planner
        self.settings = settings

    def job(self, plan: ContextPlan, documents: list[dict[str, Any]], namespace: str | None = None) -> Job:
        """The optimization of ``plan``'s context (``documents``: :meth:`ContextPlan.optimizer_documents`): the
        request's budget, ordering and language over the settings'; ``namespace``: its encoding cache tenant."""
        s, options = self.settings, plan.options
        assert plan.query is not None
        return Job(
            plan.query,
            documents,
            options.budget if options.budget is not None else s.budget,
            options.ordering or s.ordering,
            language=options.language or s.language,
            target=s.target,
            tier=s.tier,
            namespace=namespace,
        )

    async def apply(
        self, raw: bytes, headers: Mapping[str, str], backend: Backend, namespace: str | None = None
    ) -> Rewritten:
        """The body to send on for the request ``raw`` (its ``headers`` carry the ``x-ragopt-*`` options) and its
        outcome; ``namespace``: its encoding cache tenant. Raises :class:`~rag_opt.wire.errors.RequestError` for
        an invalid request, and what ``backend`` raises."""
        planner, settings = self.planner, self.settings
        try:
            plan = await off_loop(len(raw), lambda: planner(raw, headers, settings))
        except RequestError:
            raise
        except Exception as exc:  # a bug here must not reach the client
            return Rewritten(raw, Outcome("fail_open", reason=backend.unreadable(exc)))
        if not plan.options.enabled:
            return Rewritten(await self._render(plan, backend), Outcome("disabled"))
        if not plan.documents:
            return Rewritten(await self._render(plan, backend), Outcome("no_context"))
        if plan.query is None:
            return Rewritten(await self._render(plan, backend), Outcome("no_query"))
        documents = await off_loop(len(plan.raw), plan.optimizer_documents)  # (one per document: off the loop)
        attempt = await backend.run(self.job(plan, documents, namespace))
        if attempt.result is None:
            return await self._unoptimized(plan, attempt, backend)
        return await self._written(plan, attempt, backend)

    async def _written(self, plan: ContextPlan, attempt: Attempt, backend: Backend) -> Rewritten:
        """The request body with the result written back, and its outcome (by the tier that scored it)."""
        result = attempt.result
        assert result is not None
        try:
            body = await off_loop(len(plan.raw), lambda: plan.render(result))
        except Exception as exc:
            return await self._unoptimized(plan, backend.unwritable(exc, attempt), backend)
        ms = backend.record(attempt, plan)
        status = attempt.optimized
        lexical = status == "optimized_lexical"
        outcome = Outcome(status, result.tokens_before, result.tokens_after, ms, attempt.reason if lexical else None)
        outcome.over_budget = result.over_budget
        outcome.result = result
        return Rewritten(body, outcome if lexical else outcome.read_by_model(result, self.settings.expose_cache_hits))

    async def _unoptimized(self, plan: ContextPlan, attempt: Attempt, backend: Backend) -> Rewritten:
        """The request to send on unoptimized (fail-open; counted by the backend) and its outcome."""
        return Rewritten(
            await self._render(plan, backend),
            Outcome("fail_open", optimizer_ms=attempt.elapsed_ms(), reason=attempt.told),
        )

    async def _render(self, plan: ContextPlan, backend: Backend) -> bytes:
        """``plan``'s body unoptimized (its ``rag_opt`` field removed, its extension documents placed)."""
        try:
            return await off_loop(len(plan.raw), lambda: plan.render(None))
        except Exception as exc:  # last resort: the original bytes
            backend.unrendered(exc)
            return plan.raw
