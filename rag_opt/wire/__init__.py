"""The transport-free request core: each LLM API's request body read and its context found, an optimization applied
to it and written back in place, and the ``/v1/compress`` contracts read and answered — with no HTTP server, client
or metrics (importing it loads none of starlette, httpx, prometheus_client or uvicorn, nor :mod:`rag_opt.server`).

As vLLM keeps its OpenAI ``protocol`` (the wire models) and ``serving`` (the request handling) apart from the API
routers that call them, the routes of ``rag-opt serve`` (:mod:`rag_opt.server`) and the gateway adapter
(:mod:`rag_opt.adapters.gateway`, under the LiteLLM guardrail) both call this package; neither builds a stand-in of
the other. Each passes its own :class:`~rag_opt.wire.settings.WireSettings`, derived from its configuration
(``ProxySettings.wire``, ``GatewaySettings.wire``).

Modules: :mod:`.flow` (:class:`~rag_opt.wire.flow.RequestFlow`: plan, optimize through a backend, write back, the
:class:`~rag_opt.wire.flow.Outcome`), :mod:`.job` (a job and an attempt), :mod:`.settings`, the planners
:mod:`.chat`, :mod:`.responses`, :mod:`.anthropic_messages` and :mod:`.gemini` (each API's body and context),
:mod:`.documents` (:class:`~rag_opt.wire.documents.ContextPlan`: the context in a body, and writing it back),
:mod:`.request` (reading a body and the per-request options), :mod:`.markup` (document blocks in linear time),
:mod:`.json_edit` (editing the JSON body in place), :mod:`.conversation` (a list of messages read turn by turn),
:mod:`.compress` and :mod:`.compress_messages` (the two ``/v1/compress`` contracts) with their wire models
(:mod:`.compress_protocol`, :mod:`.compress_messages_protocol`), :mod:`.offload` (large work off the event loop)
and :mod:`.errors`. Nothing heavy is imported until used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = [
    "Attempt",
    "ContextPlan",
    "Job",
    "Outcome",
    "Planner",
    "RequestError",
    "RequestFlow",
    "RewriteError",
    "WireSettings",
    "plan_chat",
    "plan_gemini",
    "plan_messages",
    "plan_responses",
]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.wire.anthropic_messages import plan_messages
    from rag_opt.wire.chat import plan_chat
    from rag_opt.wire.documents import ContextPlan
    from rag_opt.wire.errors import RequestError, RewriteError
    from rag_opt.wire.flow import Outcome, Planner, RequestFlow
    from rag_opt.wire.gemini import plan_gemini
    from rag_opt.wire.job import Attempt, Job
    from rag_opt.wire.responses import plan_responses
    from rag_opt.wire.settings import WireSettings

__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "Attempt": "rag_opt.wire.job",
        "ContextPlan": "rag_opt.wire.documents",
        "Job": "rag_opt.wire.job",
        "Outcome": "rag_opt.wire.flow",
        "Planner": "rag_opt.wire.flow",
        "RequestError": "rag_opt.wire.errors",
        "RequestFlow": "rag_opt.wire.flow",
        "RewriteError": "rag_opt.wire.errors",
        "WireSettings": "rag_opt.wire.settings",
        "plan_chat": "rag_opt.wire.chat",
        "plan_gemini": "rag_opt.wire.gemini",
        "plan_messages": "rag_opt.wire.anthropic_messages",
        "plan_responses": "rag_opt.wire.responses",
    },
)
