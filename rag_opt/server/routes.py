"""The LLM API routes of ``rag-opt serve``: each is :class:`rag_opt.server.flow.ContextFlow` with its API's planner
from the transport-free core (:mod:`rag_opt.wire`), the shape of its error answers and the header that carries the
upstream's key.

- ``POST /v1/chat/completions`` (:class:`ChatCompletions`): :func:`rag_opt.wire.chat.plan_chat`, OpenAI-style
  errors, ``--upstream-api-key`` as a bearer token;
- ``POST /v1/responses`` (:class:`Responses`): :func:`rag_opt.wire.responses.plan_responses`, as chat completions;
- ``POST /v1/messages`` (:class:`AnthropicMessages`): :func:`rag_opt.wire.anthropic_messages.plan_messages`,
  Anthropic's error shape (``{"type": "error", "error": {"type", "message"}}``), ``--upstream-api-key`` as
  ``x-api-key``;
- the Gemini API's ``generateContent`` and ``streamGenerateContent`` (:class:`GeminiContent`):
  :func:`rag_opt.wire.gemini.plan_gemini`, Google's error shape (``{"error": {"code", "message", "status"}}``),
  ``--gemini-upstream-api-key`` as ``x-goog-api-key`` (:mod:`rag_opt.server.upstream`), the model for ``/stats``
  the one the path names.
"""

from __future__ import annotations

from starlette.requests import Request

from rag_opt.server.engine import Engine
from rag_opt.server.flow import ContextFlow
from rag_opt.server.paths import gemini_model
from rag_opt.server.state import ProxyState
from rag_opt.wire.anthropic_messages import plan_messages
from rag_opt.wire.chat import plan_chat
from rag_opt.wire.documents import ContextPlan
from rag_opt.wire.gemini import plan_gemini
from rag_opt.wire.responses import plan_responses

__all__ = ["AnthropicMessages", "ChatCompletions", "GeminiContent", "Responses"]


class ChatCompletions(ContextFlow):
    """The chat completions flow of one app."""

    def __init__(self, state: ProxyState, engine: Engine | None = None) -> None:
        super().__init__(state, plan_chat, engine=engine)


class Responses(ContextFlow):
    """The Responses API flow of one app (OpenAI-style errors)."""

    def __init__(self, state: ProxyState, engine: Engine | None = None) -> None:
        super().__init__(state, plan_responses, engine=engine)


class AnthropicMessages(ContextFlow):
    """The Messages API flow of one app: Anthropic-shaped errors, ``--upstream-api-key`` as ``x-api-key``."""

    def __init__(self, state: ProxyState, engine: Engine | None = None) -> None:
        super().__init__(state, plan_messages, fmt="anthropic", key_header="x-api-key", engine=engine)


class GeminiContent(ContextFlow):
    """The Gemini generateContent flow of one app: Google-shaped errors, the model read from the path."""

    def __init__(self, state: ProxyState, engine: Engine | None = None) -> None:
        super().__init__(state, plan_gemini, fmt="google", key_header="x-goog-api-key", engine=engine)

    def model_of(self, request: Request, plan: ContextPlan) -> str | None:
        return gemini_model(request.scope["path"])
