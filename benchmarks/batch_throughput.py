"""Throughput of ``rag-opt batch`` on a local Ray: 1 vs 2 optimizer actors, and a plain loop for reference.

    OMP_NUM_THREADS=1 python benchmarks/batch_throughput.py --rows 16 --actors 1 2

Each run is added to ``benchmarks/results/batch_throughput.json`` (``--out``).

Rows: the first ``--rows`` HotpotQA dev questions with their 10 paragraphs (``{"id", "question", "documents"}``
JSONL, documents titled as in the tests). Each Ray run starts a fresh local Ray with ``--num-cpus`` CPUs and a new
output folder; its wall time includes starting Ray and loading the proxy model in every actor. The reference is
one process optimizing the same rows in a loop (model loaded first, not timed). Every Ray run's output is checked
against the loop's results row by row (same context and token counts).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

from common import data_dir

from rag_opt.batch import run_batch, summary_dict  # needs the ray extra
from rag_opt.pipeline import ContextOptimizer

RESULTS = Path(__file__).resolve().parent / "results"


def _rows(n: int) -> list[dict]:
    import gzip

    out = []
    with gzip.open(data_dir() / "hotpotqa" / "dev.jsonl.gz", "rt") as fh:
        for line in fh:
            ex = json.loads(line)
            docs = [
                {"id": title, "title": title, "text": "".join(sents), "metadata": {"title": title, "n": i}}
                for i, (title, sents) in enumerate(ex["context"])
            ]
            out.append({"id": ex["_id"], "question": ex["question"], "documents": docs})
            if len(out) >= n:
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=0.33)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "batch_throughput.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    rows = _rows(args.rows)
    opt = ContextOptimizer(ratio=args.ratio)
    opt.scorer()  # load the model outside the timing
    t = time.perf_counter()
    expected = [opt.optimize(r["question"], r["documents"]) for r in rows]
    loop_s = time.perf_counter() - t
    report: dict = {
        "rows": len(rows),
        "ratio": args.ratio,
        "num_cpus": args.num_cpus,
        "batch_size": args.batch_size,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "loop": {"seconds": loop_s, "rows_per_second": len(rows) / loop_s},
        "ray": [],
    }
    print(f"loop, 1 process: {loop_s:.1f} s, {len(rows) / loop_s:.3f} rows/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "rows.jsonl"
        src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        for actors in args.actors:
            out = Path(tmp) / f"out-{actors}.parquet"
            summary = run_batch(
                src,
                out,
                actors=actors,
                num_cpus=args.num_cpus,
                rows_per_part=len(rows),
                batch_size=args.batch_size,
                ratio=args.ratio,
                progress=False,
            )
            import pyarrow.dataset as pds

            got = sorted(pds.dataset(out).to_table().to_pylist(), key=lambda r: r["row"])
            same = all(
                (g["context"], g["tokens_before"], g["tokens_after"]) == (e.context(), e.tokens_before, e.tokens_after)
                for g, e in zip(got, expected, strict=True)
            )
            entry = {
                "actors": actors,
                **summary_dict(summary),
                "matches_optimize": same,
                "load_average_at_end": os.getloadavg(),
            }
            report["ray"].append(entry)
            print(
                f"ray, {actors} actor(s): {summary.seconds:.1f} s wall (Ray start and model loads included), "
                f"{summary.rows_per_second:.3f} rows/s; matches optimize(): {same}",
                flush=True,
            )
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(out_path.read_text(encoding="utf-8"))["runs"] if out_path.is_file() else []
    runs.append(report)  # runs accumulate: on a shared machine one run says little
    out_path.write_text(json.dumps({"runs": runs}, indent=2), encoding="utf-8")
    print(f"added run {len(runs)} to {args.out}")


if __name__ == "__main__":
    main()
