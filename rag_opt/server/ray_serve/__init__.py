"""The proxy past one machine: ``rag-opt serve`` as a Ray Serve application of N replicas (``rag-opt serve-ray``).

Each replica runs the proxy app unchanged (:func:`rag_opt.server.app.create_app`) with its own model and memory
tier of the encoding cache; all replicas share the cache's Redis tier (``--cache-url``). A thin ingress reads each
request, hashes its documents (:mod:`~rag_opt.server.ray_serve.keys`) and routes it through a custom Serve request
router (:mod:`~rag_opt.server.ray_serve.router`), so requests over the same documents reach the same replica,
whose memory tier holds them; ``routing="random"`` routes at random instead. The deployments, the
application and its deployment: :mod:`~rag_opt.server.ray_serve.deployments`; the replica's ASGI driver:
:mod:`~rag_opt.server.ray_serve.asgi`. docs/scaling.md says how to run it on a cluster, and why it is built so.

Needs the ``ray`` extra (Ray Serve) beside the ``server`` extra; importing this package imports neither Ray nor
the proxy app: each name loads its module on first use (:mod:`keys` and :mod:`asgi` need no Ray).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = [
    "APP_NAME",
    "REPLICA_HEADER",
    "ROUTINGS",
    "ROUTING_KEY_HEADER",
    "DocumentRouter",
    "ForwardedRequest",
    "RagOptIngress",
    "RagOptReplica",
    "Routing",
    "app_builder",
    "build_app",
    "deploy",
    "document_texts",
    "rank_replicas",
    "routing_key",
]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.server.ray_serve.asgi import ForwardedRequest
    from rag_opt.server.ray_serve.deployments import (
        APP_NAME,
        REPLICA_HEADER,
        ROUTING_KEY_HEADER,
        ROUTINGS,
        RagOptIngress,
        RagOptReplica,
        Routing,
        app_builder,
        build_app,
        deploy,
    )
    from rag_opt.server.ray_serve.keys import document_texts, rank_replicas, routing_key
    from rag_opt.server.ray_serve.router import DocumentRouter

_DEPLOYMENTS = "rag_opt.server.ray_serve.deployments"
__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "ForwardedRequest": "rag_opt.server.ray_serve.asgi",
        "document_texts": "rag_opt.server.ray_serve.keys",
        "routing_key": "rag_opt.server.ray_serve.keys",
        "rank_replicas": "rag_opt.server.ray_serve.keys",
        "DocumentRouter": "rag_opt.server.ray_serve.router",
        **{
            n: _DEPLOYMENTS
            for n in (
                "APP_NAME",
                "REPLICA_HEADER",
                "ROUTINGS",
                "ROUTING_KEY_HEADER",
                "RagOptIngress",
                "RagOptReplica",
                "Routing",
                "app_builder",
                "build_app",
                "deploy",
            )
        },
    },
)
