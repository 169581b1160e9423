"""One optimization asked for (:class:`Job`: the question, the documents and how to optimize them) and what became
of it (:class:`Attempt`: a result, or why there is none). They carry no transport: ``rag-opt serve``'s engine
(:class:`rag_opt.server.engine.Engine`) and the gateway adapter (:class:`rag_opt.adapters.gateway.RequestOptimizer`)
each run a job their own way and answer an attempt to :class:`rag_opt.wire.flow.RequestFlow`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rag_opt.types import Budget

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = ["Attempt", "Job", "TierChoice"]

TierChoice = Literal["auto", "model", "lexical"]


@dataclass(frozen=True)
class Job:
    """What to optimize and how. ``language`` / ``target`` None: the optimizer's own. ``tier``: ``auto`` (the
    proxy model, the lexical tier when the model cannot take it), ``model`` (never the lexical tier) or
    ``lexical`` (the lexical tier only). ``namespace``: the request's tenant in the encoding cache
    (:func:`rag_opt.server.tenancy.request_namespace`; None: the common one)."""

    query: str
    documents: list[dict[str, Any]]
    budget: Budget
    ordering: str
    language: str | None = None
    target: str | None = None
    tier: TierChoice = "auto"
    namespace: str | None = None

    def settings(self) -> dict[str, Any]:
        """The keyword arguments of ``optimize`` (per-request ``language`` / ``target`` only when given: an
        optimizer passed to ``create_app`` need not take them)."""
        out: dict[str, Any] = {"ordering": self.ordering, **self.budget.as_kwargs()}
        if self.language is not None:
            out["language"] = self.language
        if self.target is not None:
            out["target"] = self.target
        return out


@dataclass(frozen=True)
class Attempt:
    """What running a job did: ``result`` (None: nothing, fail-open for ``reason``), ``reason`` (why it failed
    open, or why the lexical tier ran), ``note`` (more about a fail-open), ``t0`` (``time.perf_counter()`` when
    it began) and ``status`` (the outcome's status when the tier that ran told it, as a sidecar's answer does;
    None: by the tier, :attr:`optimized`)."""

    result: OptimizeResult | None
    t0: float
    reason: str | None = None
    note: str | None = None
    status: str | None = None

    @property
    def tier(self) -> str:
        """``model`` or ``lexical``: the tier that scored (``model`` also when nothing was scored)."""
        return "lexical" if getattr(self.result, "tier", "model") == "lexical" else "model"

    @property
    def optimized(self) -> str:
        """The status of a result written back: :attr:`status`, else ``optimized_lexical`` or ``optimized`` by
        the tier that scored."""
        if self.status is not None:
            return self.status
        return "optimized_lexical" if self.tier == "lexical" else "optimized"

    @property
    def told(self) -> str | None:
        """The reason with its note, for ``x-ragopt-reason`` / a response's ``reason``."""
        return f"{self.reason}; {self.note}" if self.note and self.reason else self.reason

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3
