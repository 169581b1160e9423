"""``rag-opt mcp``: the MCP server (stdio) with the ``optimize_context`` tool (:mod:`rag_opt.mcp_server`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Any

from rag_opt.cli.common import UserError, add_budget_args, add_engine_args, budget_from_args, optimizer_kwargs
from rag_opt.install import install_hint

__all__ = ["register"]

# the limits are rag-opt serve's settings (their defaults, bounds and RAG_OPT_* variables); what passing one does
# here is the tool's own
_LIMIT_HELP = {
    "max_documents": "a call with more documents is refused (a tool error) before anything runs",
    "max_question_tokens": "a call whose question has more target tokens is refused before segmentation",
    "max_units": "a call whose documents have more units (sentences, ...) stops after segmentation (a tool error)",
    "max_proxy_tokens": "a call whose context has more proxy-model tokens stops before the proxy model runs",
    "time_budget_ms": "an optimization still running after this many milliseconds (counted once the proxy model "
    "is loaded and the call's turn has come) is cancelled: a tool error",
    "max_body_bytes": "a longer message (one line of JSON-RPC) is answered with a JSON-RPC error, unread",
}


def register(sub: Any) -> None:
    p = sub.add_parser(
        "mcp",
        help="MCP server (stdio) with the optimize_context tool, for agents",
        description="Serve the optimize_context tool over MCP's stdio transport (needs the mcp extra). The "
        "budget options set the default a call without ratio/target_tokens gets. The limits are those of rag-opt "
        "serve, with the same defaults and RAG_OPT_* variables (the command line wins). A message that is not "
        "JSON-RPC gets a JSON-RPC error; SIGTERM or SIGINT stops the server at once. Logs go to standard error.",
    )
    add_engine_args(p)
    add_budget_args(p)
    from rag_opt.server.service_limits import SERVICE_LIMITS
    from rag_opt.server.settings_cli import add_settings_arguments

    add_settings_arguments(p.add_argument_group("limits"), names=SERVICE_LIMITS, descriptions=_LIMIT_HELP)
    p.set_defaults(handler=_mcp)


def _mcp(args: argparse.Namespace) -> int:
    try:
        import mcp.server.mcpserver  # noqa: F401
    except ImportError:
        raise UserError(f"rag-opt mcp needs the mcp extra (mcp 2): {install_hint('mcp')}") from None
    from rag_opt.mcp_server import serve_stdio
    from rag_opt.native_memory import tune_native_memory
    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.server.service_limits import SERVICE_LIMITS, ServiceLimits

    tune_native_memory()  # a long-running process: keep native memory flat (before the model loads)

    limits = ServiceLimits.from_sources({name: getattr(args, name, None) for name in SERVICE_LIMITS})
    optimizer = ContextOptimizer(**optimizer_kwargs(args), budget=budget_from_args(args))
    logging.getLogger("rag_opt").setLevel(min(logging.getLogger().getEffectiveLevel(), logging.INFO))
    # the proxy model loads while the client connects (a call waits for it; its time budget starts after)
    threading.Thread(target=_preload, args=(optimizer,), name="rag-opt-preload", daemon=True).start()
    stopped = serve_stdio(optimizer, limits)
    if stopped is not None:  # SIGTERM / SIGINT: exit now, without waiting for a thread still reading or working
        logging.shutdown()
        sys.stderr.flush()
        os._exit(128 + stopped)
    return 0


def _preload(optimizer: Any) -> None:
    try:
        optimizer.scorer()
    except Exception as exc:  # the first call reports it
        logging.getLogger("rag_opt.cli").warning("the proxy model did not load: %s: %s", type(exc).__name__, exc)
