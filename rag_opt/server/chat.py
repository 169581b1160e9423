"""``POST /v1/chat/completions``: the OpenAI chat completions route.

Its context is found by :func:`rag_opt.server.documents.plan_request` (``<document>`` blocks, large tool
messages of the current turn, the ``rag_opt`` field); the rest of the flow — optimization on the worker pool,
the lexical tier, fail-open, the ``x-ragopt-*`` headers, forwarding — is :class:`rag_opt.server.flow.ContextFlow`
(its tiers: :class:`rag_opt.server.engine.Engine`).
"""

from __future__ import annotations

from collections.abc import Mapping

from rag_opt.server.documents import ContextPlan, plan_request
from rag_opt.server.engine import Engine
from rag_opt.server.flow import MODEL_ORDERINGS, ContextFlow, Outcome
from rag_opt.server.settings import ProxySettings
from rag_opt.server.state import ProxyState

__all__ = ["MODEL_ORDERINGS", "ChatCompletions", "Outcome", "plan_chat"]


def plan_chat(raw: bytes, headers: Mapping[str, str], settings: ProxySettings) -> ContextPlan:
    """The context of a chat completion request, with the proxy's settings (document tag, tool messages)."""
    return plan_request(
        raw,
        headers,
        tag=settings.document_tag,
        tool_messages=settings.tool_messages,
        tool_min_chars=settings.tool_min_chars,
    )


class ChatCompletions(ContextFlow):
    """The chat completions flow of one app."""

    def __init__(self, state: ProxyState, engine: Engine | None = None) -> None:
        super().__init__(state, plan_chat, engine=engine)
