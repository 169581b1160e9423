"""The rag-opt proxy as a Ray Serve application: a thin ingress and N replicas of the proxy app.

``build_app(settings, replicas=N, routing="documents")`` (:func:`build_app`) is two deployments:

* :class:`RagOptReplica` (``rag-opt``, N replicas, ``cpus_per_replica`` CPUs each): one proxy app each,
  :func:`rag_opt.server.app.create_app` as it is (every route, the key check, limits, metrics), with its own
  proxy model, worker pool and memory tier of the encoding cache, all replicas sharing the Redis tier when the
  settings name one (``--cache-url``). A replica is ready once its model has loaded (or failed to: pass-through
  mode, as ``/readyz`` says); its answers carry ``x-ragopt-replica: <replica id>``. Serve checks its health
  (:meth:`RagOptReplica.check_health`) and replaces it if its app stops.
* :class:`RagOptIngress` (``rag-opt-ingress``, no CPU reserved): takes every HTTP request from Serve's proxy,
  reads the body (at most ``--max-body-bytes`` + 1 bytes, so the replica still answers a larger one 413),
  computes its routing key and forwards it to a replica through a deployment handle, streaming the answer back as
  the replica sends it.

Routing: the replica deployment's request router is :class:`~rag_opt.server.ray_serve.router.DocumentRouter`
(Serve's request-router API): a request with a routing key goes to the replica rendezvous hashing picks for the
key, one without to the less loaded of two replicas drawn at random (as Serve's default router does). The key is
the request's ``x-ragopt-routing-key`` header when it has one (a client or a gateway that knows its own affinity,
or a test reaching one replica's ``/stats``), else under ``routing="documents"`` its documents' key
(:func:`rag_opt.server.ray_serve.keys.routing_key`): requests over the same documents reach the same replica and
find them in its memory tier. Under ``routing="random"`` the documents are not read: every request without the
header is routed at random, for comparison. Why an ingress at all: Serve's HTTP proxy routes a request before its
body is read (the replica pulls the body afterwards), so no router on the HTTP hop can see the documents; the
ingress reads the body once and routes the second hop.

Running it: :func:`deploy` (Ray must be initialized; Serve's HTTP proxy listens on the settings' host and port),
or ``rag-opt serve-ray``; on a cluster with ``serve run``/``serve deploy``, through :func:`app_builder`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig
from ray.serve.handle import DeploymentResponseGenerator
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from rag_opt.server.ray_serve.asgi import ForwardedRequest, Lifespan, serve_request
from rag_opt.server.ray_serve.keys import routing_key
from rag_opt.server.ray_serve.router import DEFAULT_FALLBACK_REPLICAS
from rag_opt.server.settings import ProxySettings

if TYPE_CHECKING:  # pragma: no cover
    from ray.serve.handle import DeploymentHandle

__all__ = [
    "APP_NAME",
    "INGRESS_DEPLOYMENT",
    "REPLICA_DEPLOYMENT",
    "REPLICA_HEADER",
    "ROUTINGS",
    "ROUTING_KEY_HEADER",
    "RagOptIngress",
    "RagOptReplica",
    "Routing",
    "app_builder",
    "build_app",
    "deploy",
]

logger = logging.getLogger(__name__)

Routing = Literal["documents", "random"]
ROUTINGS: tuple[Routing, ...] = get_args(Routing)
APP_NAME = "rag-opt"
REPLICA_DEPLOYMENT = "rag-opt"
INGRESS_DEPLOYMENT = "rag-opt-ingress"
REPLICA_HEADER = "x-ragopt-replica"
ROUTING_KEY_HEADER = "x-ragopt-routing-key"
_MAX_KEY_CHARS = 256
DEFAULT_READY_TIMEOUT_S = 900.0
# by name: each process that routes to the replicas (the ingress) imports it, rag-opt installed there as here
_ROUTER = "rag_opt.server.ray_serve.router:DocumentRouter"
_PARSE_OFF_LOOP_BYTES = 256 * 1024  # larger bodies are parsed for their key on a thread, off the event loop


class RagOptReplica:
    """One replica: the proxy app of ``settings``, started (its model loaded) before Serve sends it requests.

    Args:
        settings: the proxy's settings (those ``rag-opt serve`` builds).
        ready_timeout_s: how long the model may take to load; then the replica fails to start (Serve retries).
    """

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor before the replica takes requests
        self, settings: ProxySettings, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    ) -> None:
        from rag_opt.native_memory import tune_native_memory
        from rag_opt.server.app import create_app

        tune_native_memory()  # a long-running process: keep native memory flat (before the model loads)
        # this actor's process is the replica's own: its log lines go to stderr (Ray's log folder), as rag-opt serve's
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("rag_opt").setLevel(min(logging.getLogger("rag_opt").getEffectiveLevel(), logging.INFO))
        context = serve.get_replica_context()
        self.replica_id: str = context.replica_id.unique_id
        self._header = (REPLICA_HEADER.encode(), self.replica_id.encode())
        self._app = create_app(settings)
        self._state = self._app.state.ragopt
        self._lifespan = Lifespan(self._app)
        await self._lifespan.startup()
        deadline = time.monotonic() + ready_timeout_s
        while not self._state.ready:
            if time.monotonic() > deadline:
                await self._lifespan.shutdown()
                raise RuntimeError(f"the proxy model did not load within {ready_timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        logger.info(
            "rag-opt replica %s ready (optimizer %s, mode %s)",
            self.replica_id,
            self._state.optimizer_state,
            self._state.mode,
        )

    async def serve_http(self, request: ForwardedRequest) -> AsyncIterator[list[Message]]:
        """Run one forwarded HTTP request through the app; yields the ASGI messages it sends, in batches."""
        async for batch in serve_request(self._app, request, state=self._lifespan.state, extra_headers=(self._header,)):
            yield batch

    async def check_health(self) -> None:
        """Serve's health check: fails once the app has stopped (Serve then replaces the replica)."""
        if not self._lifespan.running:
            raise RuntimeError("the rag-opt app of this replica has stopped")

    async def __del__(self) -> None:
        """Serve's graceful shutdown (after the replica's last request): the app stops (pools, caches flushed)."""
        lifespan = getattr(self, "_lifespan", None)  # (None: the constructor failed before it started the app)
        if lifespan is not None:
            await lifespan.shutdown()


class _Relayed(Response):
    """The answer of a replica, relayed message by message as it streams in (a 503 if it fails before starting)."""

    def __init__(self, stream: DeploymentResponseGenerator, path: str) -> None:
        super().__init__()
        self._stream = stream
        self._path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        try:
            async for batch in self._stream:
                for message in batch:
                    started = started or message["type"] == "http.response.start"
                    await send(message)
        except Exception as exc:  # no replica, or it died: the client gets an error, never a hang
            if started:
                logger.warning(
                    "a replica failed while streaming its answer (%s): the answer is cut", type(exc).__name__
                )
                return
            logger.warning("no replica answered (%s): 503", type(exc).__name__)
            from rag_opt.server.errors import error_response
            from rag_opt.server.paths import error_format

            answer = error_response(
                503,
                "no rag-opt replica could take the request; retry",
                "server_error",
                "replica_unavailable",
                fmt=error_format(self._path),
            )
            await answer(scope, receive, send)


class RagOptIngress:
    """The HTTP ingress: reads each request, finds its routing key (:meth:`_key`) and forwards it to a
    :class:`RagOptReplica` through ``replicas``, relaying the answer."""

    def __init__(self, replicas: DeploymentHandle, settings: ProxySettings, routing: Routing = "documents") -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self._replicas = replicas.options(stream=True)
        self._routing = routing
        self._limit = settings.max_body_bytes
        self._tag = settings.document_tag

    async def _body(self, request: Request) -> bytes:
        """The body, at most the limit + 1 bytes (a larger one is then refused 413 by the replica, as by serve)."""
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            parts.append(chunk)
            size += len(chunk)
            if size > self._limit:
                break
        return b"".join(parts)[: self._limit + 1]

    async def _key(self, request: Request, body: bytes) -> str | None:
        """The request's routing key: its ``x-ragopt-routing-key`` header (either routing), else, under document
        routing, its documents' key (:func:`~rag_opt.server.ray_serve.keys.routing_key`); None: routed at random."""
        given = request.headers.get(ROUTING_KEY_HEADER, "").strip()
        if given and len(given) <= _MAX_KEY_CHARS:
            return given
        if self._routing != "documents" or not body or len(body) > self._limit:
            return None
        encoding = request.headers.get("content-encoding")
        if len(body) > _PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(routing_key, body, tag=self._tag, content_encoding=encoding)
        return routing_key(body, tag=self._tag, content_encoding=encoding)

    async def __call__(self, request: Request) -> Response:
        try:
            body = await self._body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        key = await self._key(request, body)
        handle = self._replicas.options(session_id=key) if key else self._replicas
        forwarded = ForwardedRequest.from_scope(request.scope, body, drop_headers=(ROUTING_KEY_HEADER.encode(),))
        stream = handle.serve_http.remote(forwarded)
        assert isinstance(stream, DeploymentResponseGenerator)  # a streaming handle
        return _Relayed(stream, request.url.path)


def build_app(
    settings: ProxySettings,
    *,
    replicas: int = 2,
    routing: Routing = "documents",
    ingress_replicas: int = 1,
    cpus_per_replica: float = 1.0,
    max_ongoing_requests: int | None = None,
    fallback_replicas: int = DEFAULT_FALLBACK_REPLICAS,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
) -> serve.Application:
    """The Serve application: :class:`RagOptIngress` in front of ``replicas`` :class:`RagOptReplica`.

    Args:
        settings: the proxy's settings; its ``host`` and ``port`` are Serve's HTTP proxy's (:func:`deploy`).
        replicas: proxy replicas, one model each.
        routing: ``documents`` (requests over the same documents to the same replica) or ``random`` (the documents
            not read: at random unless the request names its routing key).
        ingress_replicas: replicas of the ingress (no CPU reserved; one per node on a large cluster).
        cpus_per_replica: CPUs reserved for each proxy replica.
        max_ongoing_requests: requests a replica takes at once, optimized or forwarded (default: the settings'
            ``max_connections``); under document routing, a replica at this bound spills to its fallback.
        fallback_replicas: document routing: replicas tried after the key's own when it is full.
        ready_timeout_s: how long a replica's model may take to load.
    """
    if replicas < 1 or ingress_replicas < 1:
        raise ValueError("replicas and ingress_replicas must be at least 1")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    ongoing = max_ongoing_requests or settings.max_connections
    router = RequestRouterConfig(
        **cast(
            dict[str, Any],
            {"request_router_class": _ROUTER, "request_router_kwargs": {"fallback_replicas": fallback_replicas}},
        )
    )  # (its signature types every option as a dict)
    replica = serve.deployment(
        name=REPLICA_DEPLOYMENT,
        num_replicas=replicas,
        max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": cpus_per_replica},
        request_router_config=router,
    )(RagOptReplica)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=ingress_replicas,
        max_ongoing_requests=max(1, ongoing * replicas // ingress_replicas),
        ray_actor_options={"num_cpus": 0},
    )(RagOptIngress)
    return ingress.bind(replica.bind(settings, ready_timeout_s), settings, routing)


def deploy(app: serve.Application, settings: ProxySettings, *, name: str = APP_NAME) -> str:
    """Start Serve's HTTP proxy on the settings' host and port (keep-alive 75 s, as ``rag-opt serve``; a Serve
    already running keeps its own) and run ``app`` under ``name`` at ``/``; returns the base URL once every
    replica is ready. Ray must be initialized (``ray.init``)."""
    serve.start(http_options=HTTPOptions(host=settings.host, port=settings.port, keep_alive_timeout_s=75))
    serve.run(app, name=name, route_prefix="/")
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"


def app_builder(args: Mapping[str, Any]) -> serve.Application:
    """The application for ``serve run`` / ``serve deploy`` (``import_path: rag_opt.server.ray_serve:app_builder``):
    ``args`` names :func:`build_app`'s options (``replicas``, ``routing``, ...) and :class:`ProxySettings` fields
    (``upstream``, ``encoding``, ``encoding_cache_url``, ...), over the ``RAG_OPT_*`` environment."""
    options = {k: args[k] for k in _BUILD_OPTIONS if k in args}
    unknown = set(args) - set(_BUILD_OPTIONS) - set(ProxySettings.model_fields)
    if unknown:
        raise ValueError(f"unknown arguments: {sorted(unknown)}")
    settings = ProxySettings.from_sources({k: v for k, v in args.items() if k in ProxySettings.model_fields})
    for k in ("replicas", "ingress_replicas", "max_ongoing_requests", "fallback_replicas"):
        if k in options:
            options[k] = int(options[k])
    for k in ("cpus_per_replica", "ready_timeout_s"):
        if k in options:
            options[k] = float(options[k])
    return build_app(settings, **options)


_BUILD_OPTIONS = (
    "replicas",
    "routing",
    "ingress_replicas",
    "cpus_per_replica",
    "max_ongoing_requests",
    "fallback_replicas",
    "ready_timeout_s",
)
