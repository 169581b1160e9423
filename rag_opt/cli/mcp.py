"""``rag-opt mcp``: the MCP server (stdio) with the ``optimize_context`` tool (:mod:`rag_opt.mcp_server`)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from rag_opt.cli.common import UserError, add_budget_args, add_engine_args, budget_from_args, optimizer_kwargs

__all__ = ["DEFAULT_RATIO", "register"]

DEFAULT_RATIO = 0.5


def register(sub: Any) -> None:
    p = sub.add_parser(
        "mcp",
        help="MCP server (stdio) with the optimize_context tool, for agents",
        description="Serve the optimize_context tool over MCP's stdio transport (needs the mcp extra). The "
        "budget options set the default a call without ratio/target_tokens gets. Logs go to standard error.",
    )
    add_engine_args(p)
    add_budget_args(p, default_ratio=DEFAULT_RATIO)
    p.set_defaults(handler=_mcp)


def _mcp(args: argparse.Namespace) -> int:
    try:
        import mcp.server.mcpserver  # noqa: F401
    except ImportError:
        raise UserError("rag-opt mcp needs the mcp extra (mcp 2): pip install 'rag-opt[mcp]'") from None
    from rag_opt.mcp_server import serve_stdio
    from rag_opt.pipeline import ContextOptimizer

    optimizer = ContextOptimizer(**optimizer_kwargs(args), budget=budget_from_args(args, default_ratio=DEFAULT_RATIO))
    logging.getLogger("rag_opt").setLevel(min(logging.getLogger().getEffectiveLevel(), logging.INFO))
    serve_stdio(optimizer)
    return 0
