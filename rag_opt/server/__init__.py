"""The HTTP proxy: optimizes the retrieved context inside OpenAI chat completions, Anthropic messages, OpenAI
responses and Gemini generateContent requests and forwards them upstream; ``POST /v1/compress`` optimizes
documents for a gateway.

``rag-opt serve --upstream URL`` runs it; :func:`create_app` builds the ASGI app from :class:`ProxySettings`
(needs the ``server`` extra: ``pip install -e '.[server]'`` from the checkout). Nothing heavy is imported until used.

Modules: :mod:`.app` (the ASGI app and its lifecycle), :mod:`.routes` (the LLM API routes: each API's planner
with its error shape), :mod:`.flow` (their shared HTTP side: decode the body, rewrite it with
:class:`rag_opt.wire.flow.RequestFlow`, forward), :mod:`.compress` and :mod:`.compress_messages`
(``POST /v1/compress``, the compress-only sidecar), :mod:`.engine` (which tier optimizes a request, for every route: the
pool, the lexical tier, fail-open), :mod:`.paths` (plain request paths, upstream URLs), :mod:`.upstream`
(forwarding) and :mod:`.relay` (relaying the answers), :mod:`.http` (the connection layer: read timeouts,
connection limit) and :mod:`.open_files`, :mod:`.pool` (the optimizer's worker pool), :mod:`.state` (what one app
holds, the process's one encoding cache included), :mod:`.settings` (settings from the command line and
environment; their checks in :mod:`.settings_checks`), :mod:`.security`, :mod:`.logs` (rate-limited repeats),
:mod:`.metrics` (``prometheus_client``, ``GET /stats``) and :mod:`.errors`.

What the routes do to a request body — reading it, finding its context, writing the optimized context back, the
``/v1/compress`` contracts — is the transport-free core, :mod:`rag_opt.wire` (which the gateway adapter calls
too), as vLLM keeps its ``protocol`` and ``serving`` apart from its API routers.
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
