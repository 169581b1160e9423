"""``rag-opt batch``: optimize many (question, documents) rows on Ray Data (:mod:`rag_opt.batch`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rag_opt.cli.common import (
    UserError,
    add_budget_args,
    add_engine_args,
    budget_from_args,
    optimizer_kwargs,
    positive_int,
)
from rag_opt.install import install_hint

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "batch",
        help="optimize many rows (question, documents) on Ray Data; resumable",
        description="Optimize every row of a JSONL or Parquet file ({'question', 'documents', 'id'?} per row) on "
        "a local Ray (default) or a cluster (--ray-address), and write a folder of Parquet parts with the "
        "optimized context, the kept documents as JSON, tokens before/after and an error column. A rerun with the "
        "same --output skips the parts already written. Needs the ray extra.",
    )
    p.add_argument("--input", "-i", required=True, help="rows as .jsonl or .parquet")
    p.add_argument("--output", "-o", required=True, help="output folder of Parquet parts, e.g. out.parquet")
    p.add_argument("--ray-address", help="a running Ray cluster (ray://HOST:10001, HOST:6379 or auto); default: local")
    p.add_argument("--actors", type=positive_int, default=1, help="optimizer actors, one model each (default 1)")
    p.add_argument("--num-cpus", type=positive_int, help="CPUs of the local Ray (default: all)")
    p.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs reserved per actor (default 1)")
    p.add_argument("--rows-per-part", type=positive_int, default=100, help="input rows per output part (default 100)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="rows per map_batches call (default 4)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide Ray's progress bars")
    add_engine_args(p)
    add_budget_args(p)
    p.set_defaults(handler=_batch)


def _batch(args: argparse.Namespace) -> int:
    try:
        import pyarrow  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        raise UserError(f"rag-opt batch needs the ray extra: {install_hint('ray')}") from None
    from rag_opt.batch import run_batch, summary_dict

    budget = budget_from_args(args)
    summary = run_batch(
        args.input,
        args.output,
        ray_address=args.ray_address,
        actors=args.actors,
        num_cpus=args.num_cpus,
        cpus_per_actor=args.cpus_per_actor,
        rows_per_part=args.rows_per_part,
        batch_size=args.batch_size,
        progress=args.progress,
        **optimizer_kwargs(args),
        **budget.as_kwargs(),
    )
    print(json.dumps(summary_dict(summary)))
    print(
        f"rag-opt: {summary.rows_optimized} rows optimized in {summary.seconds:.1f} s "
        f"({summary.rows_per_second:.2f} rows/s), {summary.rows_failed} with an error; "
        f"parts: {summary.parts - summary.parts_skipped} written, {summary.parts_skipped} already there; "
        f"{summary.output}",
        file=sys.stderr,
    )
    return 0
