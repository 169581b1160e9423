"""What parallel encoding and the encoding cache cost: cold, warm and batched, against the joint default, interleaved.

    python benchmarks/encoding.py --questions 10 --sizes 10,40 --threads 1   # → benchmarks/results/encoding.{json,png}

For each held-out HotpotQA dev question (seeded order) and each context size N, the context is the question's 10
paragraphs padded with the paragraphs of the questions that follow it (N = 40: 30 other paragraphs). Three
optimizations of the same question and documents run back to back, in a rotating order (so load drifts hit every
arm alike):

* **joint**: ``ContextOptimizer(encoding="joint")`` with its shipped probes (the default before parallel encoding);
* **parallel cold**: ``encoding="parallel"`` with an empty encoding cache: every document is encoded;
* **parallel warm**: the same documents already cached by *another* question (the next one of the dev order), so
  only this question's pass runs.

Reported per N: the median latency of each arm, the median of the per-question ratios to joint, and the cold time
per document. ``--batch K``: ``optimize_batch`` of K warm questions over one cached document set against K single
warm calls (interleaved rounds), as throughput. All figures come from this one run; nothing is hard-coded.

``--ordering`` (default: the library's, ``lost_in_the_middle``) is every arm's ordering. It changes what the joint
arm costs: ordering by document relevance makes the joint encoding read all 24 layers (its document probe's depth)
where ``input`` order reads the sentence probe's 16, while the parallel arms read their 16 either way.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from common import data_dir

from rag_opt.models.encoding_cache import EncodingCache
from rag_opt.pipeline import ContextOptimizer
from rag_opt.training.datasets import read_hotpotqa
from rag_opt.types import ORDERING_NAMES

DEFAULT_ORDERING = str(inspect.signature(ContextOptimizer).parameters["ordering"].default)

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench.encoding")


def contexts(n_questions: int, size: int) -> list[tuple[str, str, list[dict[str, str]]]]:
    """(question, another question, documents): the question's paragraphs padded with the next questions'."""
    pool = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=n_questions + size // 10 + 2)
    out = []
    for i in range(n_questions):
        docs: list[dict[str, str]] = []
        j = i
        while len(docs) < size:
            ex = pool[j % len(pool)]
            docs += [{"id": f"{ex.id}-{p}", "title": t, "text": ex.paragraph_text(p)} for p, t in enumerate(ex.titles)]
            j += 1
        out.append((pool[i].question, pool[i + 1].question, docs[:size]))
    return out


def timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    res = fn()
    return (time.perf_counter() - t) * 1e3, res


def run(args: argparse.Namespace) -> dict[str, Any]:
    common: dict[str, Any] = {
        "threads": args.threads,
        "dtype": args.dtype,
        "ratio": args.ratio,
        "ordering": args.ordering,
    }
    joint = ContextOptimizer(encoding="joint", **common)
    cache = EncodingCache(max_bytes=args.cache_mib * 2**20)
    par = ContextOptimizer(encoding="parallel", cache=cache, probe=args.probe, doc_probe=args.doc_probe, **common)
    warm_q = "What is this about?"
    joint.optimize(warm_q, [{"text": "Warm-up text."}])
    par.optimize(warm_q, [{"text": "Warm-up text."}])
    sizes = [int(x) for x in args.sizes.split(",")]
    out: dict[str, Any] = {"config": {**common, "questions": args.questions, "probe": args.probe}, "sizes": {}}
    for size in sizes:
        rows = []
        for qi, (question, other, docs) in enumerate(contexts(args.questions, size)):
            arms = ["joint", "cold", "warm"]
            arms = arms[qi % 3 :] + arms[: qi % 3]
            row: dict[str, float] = {}
            for arm in arms:
                if arm == "joint":
                    row["joint_ms"], _ = timed(lambda q=question, d=docs: joint.optimize(q, d))
                elif arm == "cold":
                    cache.clear()
                    row["cold_ms"], res = timed(lambda q=question, d=docs: par.optimize(q, d))
                    assert res.cache_misses >= len(docs), (res.cache_hits, res.cache_misses)
                else:
                    cache.clear()
                    par.optimize(other, docs)  # another question caches the documents
                    row["warm_ms"], res = timed(lambda q=question, d=docs: par.optimize(q, d))
                    assert res.cache_misses == 0 and res.cache_hits >= len(docs)
            rows.append(row)
            logger.info("N=%d q%d %s", size, qi, {k: round(v) for k, v in row.items()})
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out["sizes"][str(size)] = {
            "rows": rows,
            "median_ms": med,
            "median_ratio_cold_to_joint": statistics.median(r["cold_ms"] / r["joint_ms"] for r in rows),
            "median_ratio_warm_to_joint": statistics.median(r["warm_ms"] / r["joint_ms"] for r in rows),
            "median_speedup_warm": statistics.median(r["joint_ms"] / r["warm_ms"] for r in rows),
            "cold_ms_per_document": med["cold_ms"] / size,
            "joint_ms_per_document": med["joint_ms"] / size,
        }
    if len(sizes) > 1:
        a, b = out["sizes"][str(sizes[0])], out["sizes"][str(sizes[-1])]
        out["cold_per_document_growth"] = b["cold_ms_per_document"] / a["cold_ms_per_document"]
        out["joint_per_document_growth"] = b["joint_ms_per_document"] / a["joint_ms_per_document"]
    if args.batch:
        out["batch"] = batch_throughput(par, cache, args)
    out["cache"] = cache.stats().to_dict()
    return out


def batch_throughput(par: ContextOptimizer, cache: EncodingCache, args: argparse.Namespace) -> dict[str, Any]:
    """optimize_batch of K warm questions (one cached document set) vs K single calls, interleaved rounds."""
    pool = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.batch + 1)
    docs = [{"id": str(p), "title": t, "text": pool[0].paragraph_text(p)} for p, t in enumerate(pool[0].titles)]
    questions = [ex.question for ex in pool[1 : args.batch + 1]]
    par.optimize(pool[0].question, docs)  # caches the documents
    single, batched = [], []
    for r in range(args.rounds):
        order = ["single", "batch"] if r % 2 == 0 else ["batch", "single"]
        for arm in order:
            if arm == "single":
                ms, res = timed(lambda: [par.optimize(q, docs) for q in questions])
                single.append(ms)
            else:
                ms, res = timed(lambda: par.optimize_batch(questions, [docs] * len(questions)))
                batched.append(ms)
            assert all(x.cache_misses == 0 for x in res)
    return {
        "k": args.batch,
        "single_ms": single,
        "batch_ms": batched,
        "throughput_ratio_median": statistics.median(s / b for s, b in zip(single, batched, strict=True)),
    }


def print_table(res: dict[str, Any]) -> None:
    ordering = res["config"].get("ordering", "not recorded")
    print(f"threads {res['config']['threads']}, {res['config']['questions']} questions per size, ordering {ordering}")
    print(
        f"{'N':>4} {'joint ms':>9} {'cold ms':>8} {'warm ms':>8} {'cold/joint':>11} {'warm/joint':>11} "
        f"{'cold ms/doc':>12}"
    )
    for n, r in res["sizes"].items():
        m = r["median_ms"]
        print(
            f"{n:>4} {m['joint_ms']:9.0f} {m['cold_ms']:8.0f} {m['warm_ms']:8.0f} "
            f"{r['median_ratio_cold_to_joint']:11.3f} "
            f"{r['median_ratio_warm_to_joint']:11.3f} {r['cold_ms_per_document']:12.1f}"
        )
    if "cold_per_document_growth" in res:
        print(
            f"time per document, largest N over smallest: parallel cold {res['cold_per_document_growth']:.2f}x, "
            f"joint {res['joint_per_document_growth']:.2f}x"
        )
    if "batch" in res:
        b = res["batch"]
        print(
            f"optimize_batch of {b['k']} warm questions: {b['throughput_ratio_median']:.2f}x the throughput of "
            "single calls"
        )


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(res["sizes"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = range(len(sizes))
    w = 0.27
    for k, (arm, label) in enumerate(
        [("joint_ms", "joint (today)"), ("cold_ms", "parallel, cold"), ("warm_ms", "parallel, warm")]
    ):
        ax.bar([i + (k - 1) * w for i in x], [res["sizes"][n]["median_ms"][arm] for n in sizes], w, label=label)
    ax.set_xticks(list(x), [f"{n} paragraphs" for n in sizes])
    ax.set_ylabel("median optimize() ms")
    ax.set_yscale("log")
    ax.set_title("Reading each document once (same run, interleaved)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--sizes", default="10,40")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--ratio", type=float, default=1 / 3)
    ap.add_argument(
        "--ordering",
        default=DEFAULT_ORDERING,
        choices=ORDERING_NAMES,
        help=f"every arm's ordering (default: the library's, {DEFAULT_ORDERING})",
    )
    ap.add_argument("--probe", default="auto", help="the parallel arm's sentence probe")
    ap.add_argument("--doc-probe", default="auto", help="the parallel arm's document probe")
    ap.add_argument("--cache-mib", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="K for the optimize_batch comparison (0: skip)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "encoding"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    if args.report_only:
        res = json.loads(out.with_suffix(".json").read_text())
    else:
        args.threads = int(args.threads) if args.threads.isdigit() else args.threads
        res = run(args)
        out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print_table(res)
    plot(res, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
