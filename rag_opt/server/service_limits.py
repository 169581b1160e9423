"""The limits on one optimization that every rag-opt service applies (``rag-opt serve``, ``rag-opt mcp``): their
defaults, bounds, flags and ``RAG_OPT_*`` variables are the :class:`~rag_opt.server.settings.ProxySettings` fields
of the same names."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rag_opt.server.settings import ENV_PREFIX, ProxySettings
from rag_opt.work import WorkLimits

__all__ = ["SERVICE_LIMITS", "ServiceLimits"]

SERVICE_LIMITS = (
    "max_documents",
    "max_question_tokens",
    "max_units",
    "max_proxy_tokens",
    "time_budget_ms",
    "max_body_bytes",
)


@dataclass(frozen=True)
class ServiceLimits:
    """The :data:`SERVICE_LIMITS` of a service: their defaults, bounds, flags and ``RAG_OPT_*`` variables are the
    :class:`ProxySettings` fields of the same names, so ``rag-opt mcp`` limits a call as ``rag-opt serve`` limits
    a request."""

    max_documents: int
    max_question_tokens: int
    max_units: int
    max_proxy_tokens: int
    time_budget_ms: float
    max_body_bytes: int

    @classmethod
    def of(cls, settings: ProxySettings) -> ServiceLimits:
        return cls(**{name: getattr(settings, name) for name in SERVICE_LIMITS})

    @classmethod
    def from_sources(cls, cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> ServiceLimits:
        """The limits from command-line values (None = not given) over their ``RAG_OPT_*`` variables, validated
        as :meth:`ProxySettings.from_sources` validates them (the same messages)."""
        env = os.environ if env is None else env
        variables = {ENV_PREFIX + name.upper() for name in SERVICE_LIMITS}
        given = {k: v for k, v in (cli or {}).items() if k in SERVICE_LIMITS}
        settings = ProxySettings.from_sources(
            {**given, "upstream": "http://limits.invalid"}, {k: v for k, v in env.items() if k in variables}
        )
        return cls.of(settings)

    @property
    def time_budget_s(self) -> float:
        return self.time_budget_ms / 1e3

    def work_limits(self) -> WorkLimits:
        """The limits :func:`rag_opt.work.scope` enforces inside an optimization."""
        return WorkLimits(
            max_units=self.max_units,
            max_proxy_tokens=self.max_proxy_tokens,
            max_question_tokens=self.max_question_tokens,
        )
