"""A realistic replay of retrieval traffic: how often documents repeat, and what the encoding cache saves.

    python benchmarks/cache.py --questions 60            # → benchmarks/results/cache.json

Every paragraph of HotpotQA dev (1,466 questions × ~10 paragraphs) is pooled into one corpus; each replayed question
(the first ``--questions`` of the seeded dev order) retrieves its top 10 by BM25 (bm25s) from the whole corpus, so
popular paragraphs come back across questions as they do in production. Replayed in that order, interleaved per
question (rotating order):

* **joint**: today's default (``encoding="joint"``), no cache;
* **lexical**: the lexical tier (``tier="lexical"``), no model;
* **parallel, cold start**: ``encoding="parallel"`` with an empty in-memory cache that fills as the replay goes.

Then ``rag-opt index`` (the command users run) precomputes the encodings of the replay's retrieved paragraphs into
a disk cache, and the replay runs again with a fresh process-level cache backed by that folder (**parallel, after
index**). Reported: the cache hit rate of each parallel replay and p50 / p90 latency of every arm, from this run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import data_dir, run_or_report

from rag_opt.models.encoding_cache import EncodingCache
from rag_opt.pipeline import ContextOptimizer
from rag_opt.training.datasets import read_hotpotqa
from rag_opt.types import DEFAULT_ORDERING, ORDERING_NAMES

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench.cache")


def corpus() -> list[dict[str, str]]:
    """Every HotpotQA dev paragraph once (by title), as documents."""
    seen: dict[str, dict[str, str]] = {}
    with gzip.open(data_dir() / "hotpotqa" / "dev.jsonl.gz", "rt") as fh:
        for line in fh:
            ex = json.loads(line)
            for title, sents in ex["context"]:
                seen.setdefault(title, {"id": title, "title": title, "text": "".join(sents)})
    return list(seen.values())


def retrieve(questions: list[str], docs: list[dict[str, str]], k: int) -> list[list[dict[str, str]]]:
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([f"{d['title']}\n{d['text']}" for d in docs], stopwords="en", show_progress=False))
    hits, _ = retriever.retrieve(bm25s.tokenize(questions, stopwords="en", show_progress=False), k=k)
    return [[docs[int(i)] for i in row] for row in hits]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(ms), "p90_ms": pct(ms, 0.9), "n": len(ms)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    examples = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.questions)
    pool = corpus()
    questions = [ex.question for ex in examples]
    retrieved = retrieve(questions, pool, args.k)
    unique = {d["id"] for docs in retrieved for d in docs}
    logger.info("corpus %d paragraphs; %d questions retrieve %d distinct ones", len(pool), len(questions), len(unique))
    common: dict[str, Any] = {"threads": args.threads, "ratio": args.ratio, "ordering": args.ordering}
    joint = ContextOptimizer(encoding="joint", **common)
    lexical = ContextOptimizer(tier="lexical", **common)
    cold_cache = EncodingCache()
    par = ContextOptimizer(encoding="parallel", cache=cold_cache, probe=args.probe, **common)
    for opt in (joint, lexical, par):
        opt.optimize("warm up?", [{"text": "Warm-up text."}])
    cold_cache.clear()
    base = cold_cache.stats()
    ms: dict[str, list[float]] = {"joint": [], "lexical": [], "parallel_cold": []}
    for i, (q, docs) in enumerate(zip(questions, retrieved, strict=True)):
        arms = ["joint", "lexical", "parallel_cold"]
        for arm in arms[i % 3 :] + arms[: i % 3]:
            opt = {"joint": joint, "lexical": lexical, "parallel_cold": par}[arm]
            t = time.perf_counter()
            opt.optimize(q, docs)
            ms[arm].append((time.perf_counter() - t) * 1e3)
    st = cold_cache.stats()
    cold_hits, cold_misses = st.hits - base.hits, st.misses - base.misses
    out: dict[str, Any] = {
        "config": {**common, "questions": len(questions), "k": args.k, "probe": args.probe},
        "corpus_paragraphs": len(pool),
        "distinct_retrieved": len(unique),
        "parallel_cold_hit_rate": cold_hits / max(cold_hits + cold_misses, 1),
    }
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "corpus.jsonl"
        rows.write_text("".join(json.dumps(d) + "\n" for d in pool if d["id"] in unique))
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "rag_opt.cli", "index", "--input", str(rows), "--cache-dir", f"{tmp}/enc"]
        if args.probe != "auto":  # index at the depth that probe reads (the keys include the depth)
            from rag_opt.compressors.probe import Probe

            cmd += ["--layers", str(Probe.load(args.probe).layout.num_layers)]
        subprocess.run(cmd, check=True)
        out["index_seconds"] = time.perf_counter() - t
        disk = EncodingCache(disk=f"{tmp}/enc")
        indexed = ContextOptimizer(encoding="parallel", cache=disk, probe=args.probe, **common)
        indexed.optimize("warm up?", [{"text": "Warm-up text."}])
        before = disk.stats()
        ms["parallel_after_index"] = []
        for q, docs in zip(questions, retrieved, strict=True):
            t = time.perf_counter()
            indexed.optimize(q, docs)
            ms["parallel_after_index"].append((time.perf_counter() - t) * 1e3)
        st = disk.stats()
        hits, misses = st.hits - before.hits, st.misses - before.misses
        out["parallel_after_index_hit_rate"] = hits / max(hits + misses, 1)
    out["latency"] = {arm: summary(v) for arm, v in ms.items()}
    out["median_ratio_to_joint"] = {
        arm: statistics.median(a / b for a, b in zip(v, ms["joint"], strict=True)) for arm, v in ms.items()
    }
    return out


def print_table(res: dict[str, Any]) -> None:
    c = res["config"]
    print(
        f"{c['questions']} HotpotQA dev questions, top {c['k']} by BM25 from {res['corpus_paragraphs']} paragraphs "
        f"({res['distinct_retrieved']} distinct retrieved); hit rate cold {res['parallel_cold_hit_rate']:.2f}, "
        f"after index {res['parallel_after_index_hit_rate']:.2f} (index took {res['index_seconds']:.0f} s)"
    )
    print(f"every arm's ordering: {c.get('ordering', 'not recorded')}")
    print(f"{'arm':>22} {'p50 ms':>8} {'p90 ms':>8} {'× joint':>8}")
    for arm, s in res["latency"].items():
        print(f"{arm:>22} {s['p50_ms']:8.0f} {s['p90_ms']:8.0f} {res['median_ratio_to_joint'][arm]:8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ratio", type=float, default=1 / 3)
    ap.add_argument("--probe", default="auto", help="the parallel arm's sentence probe")
    ap.add_argument(
        "--ordering",
        choices=ORDERING_NAMES,
        default=DEFAULT_ORDERING,
        help=f"every arm's ordering (default: the library's, {DEFAULT_ORDERING}); ordering by document relevance "
        "makes the joint arm read 24 layers where input order reads 16",
    )
    ap.add_argument("--out", default=str(RESULTS / "cache.json"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run_or_report(Path(args.out), args.report_only, lambda: run(args), print_table)


if __name__ == "__main__":
    main()
