"""``rag-opt serve``: the HTTP service in front of an LLM server. Its flags come from the settings model."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from rag_opt.cli.common import UserError
from rag_opt.install import install_hint

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.server.settings import ProxySettings

__all__ = ["register", "startup_line"]

logger = logging.getLogger("rag_opt.cli")

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def register(sub: Any) -> None:
    from rag_opt.server.settings_cli import add_settings_arguments

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible proxy: optimize the context of chat requests, forward them upstream",
        description="HTTP proxy for the OpenAI chat completions and Responses, Anthropic Messages and Gemini "
        "generateContent APIs (needs the server extra): /v1/... goes to --upstream, the Gemini API's paths "
        "(/v1beta/..., /v1/models/MODEL:generateContent) to --gemini-upstream. Every option can also be set by "
        "the environment variable RAG_OPT_<OPTION> (e.g. RAG_OPT_UPSTREAM, RAG_OPT_RATIO, RAG_OPT_UPSTREAM_API_KEY); "
        "the command line wins.",
    )
    add_settings_arguments(p)
    p.set_defaults(handler=_serve)


def startup_line(settings: ProxySettings) -> str:
    """The line ``rag-opt serve`` prints when it starts: where it listens, the upstreams it forwards to (the Gemini
    API's only when ``--gemini-upstream`` was given; credentials in a URL shown as ``***``) and how it optimizes."""
    from rag_opt.server.settings_checks import redact_url

    budget = ", ".join(f"{k}={v}" for k, v in settings.budget.as_kwargs().items() if v is not None)
    gemini = (
        f", the Gemini API's paths (/v1beta/...) -> {redact_url(settings.gemini_upstream)}"
        if "gemini_upstream" in settings.model_fields_set
        else ""
    )
    return (
        f"rag-opt proxy on http://{settings.host}:{settings.port}/v1 -> {redact_url(settings.upstream)}{gemini} "
        f"({budget}, ordering={settings.options.ordering}, time budget {settings.time_budget_ms:.0f} ms, "
        f"{settings.max_concurrency} worker(s), queue {settings.queue_bound}, on overload {settings.on_overload}, "
        f"proxy key {'required' if settings.api_key is not None else 'off'})"
    )


def _serve(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError(f"rag-opt serve needs the server extra: {install_hint('server')}") from None
    from rag_opt.native_memory import tune_native_memory
    from rag_opt.server.app import create_app
    from rag_opt.server.http import uvicorn_options

    tune_native_memory()  # a long-running process: keep native memory flat (before the model loads)
    from rag_opt.server.settings_cli import settings_from_args

    settings = settings_from_args(args)
    if settings.options.probe not in (None, "auto"):  # validate a probe file before serving (not at first use)
        from rag_opt.compressors.probe import Probe

        Probe.load(settings.options.probe)
    app = create_app(settings)
    logging.getLogger("rag_opt").setLevel(min(logging.getLogger().getEffectiveLevel(), logging.INFO))
    print(startup_line(settings), file=sys.stderr)
    if settings.host not in _LOOPBACK and settings.api_key is None:
        logger.warning(
            "listening on %s without --api-key: anyone who can reach this port can send requests through it "
            "(with your --upstream-api-key and --gemini-upstream-api-key, if set)",
            settings.host,
        )
    if settings.host not in _LOOPBACK and settings.allowed_hosts is None:
        logger.info(
            "requests must name this proxy in their Host header by an IP address%s: list the host names clients "
            "use with --allowed-hosts (DNS rebinding guard)",
            "" if settings.host in ("0.0.0.0", "::") else f" ({settings.host})",
        )
    if settings.log_bodies:
        logger.warning("--log-bodies: request and response bodies are logged (credentials redacted)")
    # rag-opt's connection layer (read timeouts, connection limit), its own access log (no query strings), idle
    # client connections kept 75 s (longer than client pools keep them: a client never sends a request on a
    # connection the proxy is closing), the upstream's Server and Date headers relayed
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="debug" if args.verbose >= 2 else "info",
        **uvicorn_options(settings, app.state.ragopt.metrics),
    )
    return 0
