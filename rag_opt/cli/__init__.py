"""The ``rag-opt`` command line: optimize, explain, models, serve, serve-ray, mcp, batch, index, cache, calibrate,
train-probe, train-doc-probe.

Errors rag-opt raises on purpose (:class:`~rag_opt.errors.RagOptError`: bad files, bad settings, a missing
model) and the OS and JSON errors expected from user files exit with status 2 (1 for a model that cannot
load) and one clear ``rag-opt: error: ...`` line. Anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from rag_opt.errors import ModelNotFoundError, RagOptError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from rag_opt.cli import batch, cache, index, mcp, models, optimize, serve, serve_ray, training

    parser = argparse.ArgumentParser(
        prog="rag-opt",
        description="Optimize retrieved context for an LLM: compress sentences, reorder documents.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (optimize, models, training, serve, serve_ray, mcp, batch, index, cache):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # hide transformers' weight-loading progress bars (read when they are imported)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return int(handler(args))
    except ModelNotFoundError as exc:
        print(f"rag-opt: error: {exc}", file=sys.stderr)
        return 1
    except (RagOptError, OSError, json.JSONDecodeError) as exc:
        print(f"rag-opt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
