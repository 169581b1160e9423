"""``rag-opt optimize`` and ``rag-opt explain``: run the optimizer on documents from a JSONL file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rag_opt.cli.common import (
    UserError,
    add_budget_args,
    add_optimizer_args,
    budget_from_args,
    build_optimizer,
    read_documents,
)

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser("optimize", help="compress and reorder documents for a query")
    add_optimizer_args(p)
    add_budget_args(p)
    p.add_argument("--keep-best-per-doc", action="store_true", help="keep at least the best sentence of each document")
    p.add_argument("--keep-first", action="store_true", help="always keep each document's first sentence")
    p.add_argument(
        "--drop-below-best",
        type=float,
        default=None,
        metavar="SHARE",
        help="under a budget, drop the documents whose relevance is below SHARE (0-1] of the best one's",
    )
    p.add_argument(
        "--no-antecedents",
        dest="keep_antecedents",
        action="store_false",
        help="keep a sentence opening with It/She/These/... without the sentence before it (default: only with it)",
    )
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="do not position-calibrate document relevance (default: calibrate when a profile exists)",
    )
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(handler=_optimize)

    p = sub.add_parser("explain", help="write an HTML report of what rag-opt keeps, drops and reorders, and why")
    add_optimizer_args(p)
    p.add_argument("--out", "-o", required=True, help="where to write the HTML report; - for stdout")
    add_budget_args(p)
    p.set_defaults(handler=_explain)


def _optimize(args: argparse.Namespace) -> int:
    opt = build_optimizer(args)
    docs = read_documents(args.input)
    result = opt.optimize(args.query, docs, budget=budget_from_args(args))
    if args.json:
        print(result.to_json())
        return 0
    print(result.context())
    saved = result.tokens_saved
    pct = 100.0 * saved / result.tokens_before if result.tokens_before else 0.0
    print(
        f"\n--- rag-opt: {result.tokens_before} → {result.tokens_after} tokens ({result.target_tokenizer}), "
        f"saved {saved} ({pct:.0f}%); {len(result.documents)} of {len(docs)} documents kept; "
        f"scorer: {result.scorer}; {result.timings.total_ms:.0f} ms",
        file=sys.stderr,
    )
    for warning in result.warnings:  # e.g. why nothing was compressed
        print(f"--- rag-opt warning: {warning}", file=sys.stderr)
    return 0


def _explain(args: argparse.Namespace) -> int:
    from rag_opt.report import render_html

    opt = build_optimizer(args)
    out = Path(args.out) if args.out != "-" else None
    if out is not None and not out.parent.is_dir():
        raise UserError(f"output folder not found: {out.parent}")
    docs = read_documents(args.input)
    result = opt.optimize(args.query, docs, budget=budget_from_args(args))
    page = render_html(result, docs)
    if out is None:
        sys.stdout.write(page)
        return 0
    out.write_text(page, encoding="utf-8")
    print(
        f"rag-opt: wrote {out} ({len(result.documents)} of {len(docs)} documents kept, "
        f"{result.tokens_before} → {result.tokens_after} tokens, scorer: {result.scorer})",
        file=sys.stderr,
    )
    return 0
