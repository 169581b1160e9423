"""The settings the transport-free core reads: where a request's context is found (the document tag, tool
results) and the defaults of its optimization (budget, ordering, language, target tokenizer, tier), less than a
server's or a gateway's whole configuration.

Each surface derives them from its own: :attr:`rag_opt.server.settings.ProxySettings.wire` (``rag-opt serve``'s
flags) and :attr:`rag_opt.adapters.gateway.GatewaySettings.wire` (a gateway adapter's options), so neither builds
the other's settings to call the planners or the flow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rag_opt.types import DEFAULT_ORDERING, DEFAULT_RATIO, Budget
from rag_opt.wire.job import TierChoice

__all__ = ["WireSettings"]


@dataclass(frozen=True)
class WireSettings:
    """What the planners and :class:`~rag_opt.wire.flow.RequestFlow` read; a request's ``rag_opt`` field and
    ``x-ragopt-*`` headers override the budget, ordering and language.

    ``document_tag``: context documents are ``<TAG ...>...</TAG>`` blocks; ``tool_messages``: large tool results
    of the current turn are context, from ``tool_min_chars`` characters. ``budget``, ``ordering``: a job's when
    the request gives none; ``language``, ``target``: a job's when the request gives none (None: the optimizer's
    own); ``tier``: the tier a job asks for; ``expose_cache_hits``: an outcome reports the request's encoding
    cache hits and misses (parallel encoding)."""

    document_tag: str = "document"
    tool_messages: bool = True
    tool_min_chars: int = 2000
    budget: Budget = field(default_factory=lambda: Budget(ratio=DEFAULT_RATIO))
    ordering: str = DEFAULT_ORDERING
    language: str | None = None
    target: str | None = None
    tier: TierChoice = "auto"
    expose_cache_hits: bool = False
