"""``rag-opt serve-ray``: the proxy as a Ray Serve application of N replicas (:mod:`rag_opt.server.ray_serve`).

The proxy's flags are ``rag-opt serve``'s (the same settings model); the Ray flags say how many replicas, how
requests are routed to them and where Ray runs (a local Ray by default; ``--ray-address`` or ``RAY_ADDRESS``: a
cluster).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any

from rag_opt.cli.common import UserError, positive_float, positive_int
from rag_opt.install import install_hint

__all__ = ["register"]

logger = logging.getLogger("rag_opt.cli")


def register(sub: Any) -> None:
    from rag_opt.server.settings_cli import add_settings_arguments

    p = sub.add_parser(
        "serve-ray",
        help="the proxy on Ray Serve: N replicas, requests over the same documents routed to the same replica",
        description="Run rag-opt serve as a Ray Serve application (needs the server and ray extras): N replicas of "
        "the proxy, each with its own model and memory tier of the encoding cache, sharing the Redis tier "
        "(--cache-url redis://...); an ingress routes requests over the same documents to the same replica "
        "(--routing documents) or at random (--routing random). Serve's HTTP proxy listens on --host/--port. "
        "Ray: local (--num-cpus), or a cluster (--ray-address, or RAY_ADDRESS). docs/scaling.md has the details. "
        "Every proxy option can also be set by the environment variable RAG_OPT_<OPTION>.",
    )
    ray_group = p.add_argument_group("Ray Serve")
    ray_group.add_argument(
        "--replicas", type=positive_int, default=2, help="proxy replicas, one model each (default 2)"
    )
    ray_group.add_argument(
        "--routing",
        choices=["documents", "random"],
        default="documents",
        help="documents: requests over the same documents go to the same replica (default); random: Serve's "
        "default routing, for comparison",
    )
    ray_group.add_argument(
        "--ray-address",
        help="a running Ray cluster (HOST:6379, ray://HOST:10001 or auto; default: RAY_ADDRESS, else local)",
    )
    ray_group.add_argument("--num-cpus", type=positive_int, help="CPUs of the local Ray (default: all)")
    ray_group.add_argument(
        "--cpus-per-replica", type=positive_float, default=1.0, help="CPUs reserved per proxy replica (default 1)"
    )
    ray_group.add_argument(
        "--ingress-replicas", type=positive_int, default=1, help="replicas of the routing ingress (default 1)"
    )
    ray_group.add_argument(
        "--max-ongoing-requests",
        type=positive_int,
        help="requests one replica takes at once; under document routing a replica at this bound spills to the "
        "next (default: --max-connections)",
    )
    ray_group.add_argument("--app-name", default="rag-opt", help="the Serve application's name (default rag-opt)")
    ray_group.add_argument(
        "--detach",
        action="store_true",
        help="deploy on the cluster and exit, leaving the application running (needs --ray-address or RAY_ADDRESS)",
    )
    add_settings_arguments(p)
    p.set_defaults(handler=_serve_ray)


def _serve_ray(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
        from ray import serve
    except ImportError:
        raise UserError(f"rag-opt serve-ray needs the server and ray extras: {install_hint('server,ray')}") from None
    import ray

    from rag_opt.server.ray_serve.deployments import build_app, deploy
    from rag_opt.server.settings_checks import redact_url
    from rag_opt.server.settings_cli import settings_from_args

    settings = settings_from_args(args)
    if settings.options.probe not in (None, "auto"):  # validate a probe file before deploying (not in a replica)
        from rag_opt.compressors.probe import Probe

        Probe.load(settings.options.probe)
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if args.detach and not address:
        raise UserError(
            "--detach needs a running Ray cluster (--ray-address or RAY_ADDRESS): a local Ray ends with this command"
        )
    app = build_app(
        settings,
        replicas=args.replicas,
        routing=args.routing,
        ingress_replicas=args.ingress_replicas,
        cpus_per_replica=args.cpus_per_replica,
        max_ongoing_requests=args.max_ongoing_requests,
    )
    logging.getLogger("rag_opt").setLevel(min(logging.getLogger().getEffectiveLevel(), logging.INFO))
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, log_to_driver=not args.detach)
        else:
            ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    signal.signal(signal.SIGTERM, _interrupt)  # stopped like Ctrl-C: the application is deleted, Ray stopped
    try:
        print(
            f"rag-opt: deploying {args.replicas} replica(s), {args.routing} routing; the models load...",
            file=sys.stderr,
        )
        url = deploy(app, settings, name=args.app_name)
        print(
            f"rag-opt on Ray Serve: {url}/v1 -> {redact_url(settings.upstream)} ({args.replicas} replica(s), "
            f"{args.routing} routing, encoding {settings.options.encoding}, shared cache "
            f"{'on' if settings.encoding_cache_url else 'off'}, proxy key "
            f"{'required' if settings.api_key is not None else 'off'})",
            file=sys.stderr,
        )
        if settings.encoding_cache_url is None and args.replicas > 1:
            logger.warning("no --cache-url: each replica encodes every document it reads itself (no shared tier)")
        if args.detach:
            print(f"rag-opt: application {args.app_name!r} left running; `serve shutdown` stops it", file=sys.stderr)
            return 0
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("rag-opt: stopping", file=sys.stderr)
    finally:
        # a second signal must not cut the clean-up short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not args.detach:
            try:
                serve.delete(args.app_name)
            except Exception as exc:  # noqa: BLE001 - stopping: report and go on
                logger.warning("could not delete the Serve application (%s)", exc)
            if started:
                serve.shutdown()
                ray.shutdown()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
