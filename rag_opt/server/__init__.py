"""The HTTP proxy: optimizes the retrieved context inside OpenAI chat completions, Anthropic messages, OpenAI
responses and Gemini generateContent requests and forwards them upstream; ``POST /v1/compress`` optimizes
documents for a gateway.

``rag-opt serve --upstream URL`` runs it; :func:`create_app` builds the ASGI app from :class:`ProxySettings`
(needs the ``server`` extra: ``pip install -e '.[server]'`` from the checkout). Nothing heavy is imported until used.

Modules: :mod:`.app` (the ASGI app and its lifecycle), :mod:`.flow` (the flow shared by the LLM API routes:
find the context, optimize it, write it back, forward), :mod:`.chat`, :mod:`.anthropic_messages`,
:mod:`.responses` and :mod:`.gemini` (each API's context), :mod:`.compress` (``POST /v1/compress``, the
compress-only sidecar),
:mod:`.engine` (which tier optimizes a request, for every route: the pool, the lexical tier, fail-open),
:mod:`.request` (reading a request and its per-request options), :mod:`.documents` (the context inside the
messages, and writing it back), :mod:`.markup` (finding document blocks in linear time),
:mod:`.json_edit` (editing the JSON body in place), :mod:`.paths` (plain request paths, upstream URLs),
:mod:`.upstream` (forwarding and relaying), :mod:`.http` (the connection layer: read timeouts, connection limit),
:mod:`.pool` (the optimizer's worker pool), :mod:`.state` (what one app holds, the process's one encoding cache
included), :mod:`.settings` (settings from the
command line and environment), :mod:`.security`, :mod:`.logs` (rate-limited repeats), :mod:`.metrics`
(``prometheus_client``, ``GET /stats``) and :mod:`.errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = ["ProxySettings", "create_app"]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.server.app import create_app
    from rag_opt.server.settings import ProxySettings

__getattr__, __dir__ = lazy_module(
    __name__, {"create_app": "rag_opt.server.app", "ProxySettings": "rag_opt.server.settings"}
)
