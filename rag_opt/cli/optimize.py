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
from rag_opt.types import DEFAULT_ORDERING, DEFAULT_RATIO

__all__ = ["register"]


OPTIMIZE_DESCRIPTION = f"""\
Compress and reorder retrieved documents for a question: keep the sentences
most relevant to --query within the budget (default --ratio {DEFAULT_RATIO}: that share
of the context's tokens in the target LLM's tokenizer) and order the kept
documents (default --ordering {DEFAULT_ORDERING}).

Output: the optimized context on standard output; a one-line summary (tokens
before and after, documents kept, time) and any warnings on standard error.
--json prints the whole result instead (kept spans, scores, timings).

Input (--input FILE, or - for standard input): JSON lines, one document per
line, in the retriever's order: a JSON string, or an object
{{"text": ..., "id": ..., "title": ..., "metadata": {{...}}}} (only "text" is
required). The first call loads the embedded proxy model (a few seconds);
--tier lexical needs no model."""

OPTIMIZE_EXAMPLE = """\
example:
  echo '{"title": "Honey", "text": "Bees make honey from nectar. It never spoils."}' > docs.jsonl
  echo '{"title": "Bread", "text": "Bread is baked from flour. It goes stale."}' >> docs.jsonl
  rag-opt optimize --query "How is honey made?" --input docs.jsonl --ratio 0.5"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "optimize",
        help="compress and reorder documents for a query",
        description=OPTIMIZE_DESCRIPTION,
        epilog=OPTIMIZE_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_optimizer_args(p)
    add_budget_args(p)
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
    t = result.timings
    loading = f", {t.load_ms:.0f} ms of it loading the {'proxy model' if result.proxy_model else 'lexical probe'}"
    print(
        f"\n--- rag-opt: {result.tokens_before} → {result.tokens_after} tokens ({result.target_tokenizer}), "
        f"saved {saved} ({pct:.0f}%); {len(result.documents)} of {len(docs)} documents kept; "
        f"scorer: {result.scorer}; {t.total_ms:.0f} ms" + (loading if t.load_ms >= 0.5 else ""),
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
