"""The same input gives the same output: kept text and scores of one ``optimize()`` per question against
``optimize_batch`` over all of them, with and without the encoding cache, and at one and at two threads, on held-out
HotpotQA dev questions (issue 52, A6):

    python benchmarks/determinism.py --questions 100          # → results/determinism.json

For each mode the questions whose kept text differs from the reference (one call each, no cache, one thread), the
documents whose kept text differs, and the largest document-score difference are reported. The modes: a batch
(``optimize_batch``) with and without the cache, single calls with a cold cache, single calls over a cache a batch
filled, single calls over a cache filled one document per call (each document read in a pass of its own, as when
it was first retrieved for another question), single calls at two threads, and a batch that shares its passes
(``share_passes=True``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from common import data_dir, run_or_report
from compression import hotpot_documents

from rag_opt.models.encoding_cache import EncodingCache
from rag_opt.pipeline import ContextOptimizer
from rag_opt.training.datasets import read_hotpotqa
from rag_opt.types import OptimizeResult

logger = logging.getLogger("bench.determinism")
RESULTS = Path(__file__).resolve().parent / "results"


def _kept(result: OptimizeResult) -> dict[str, str]:
    return {d.id: d.text for d in result.documents}


def _scores(result: OptimizeResult) -> dict[str, float]:
    return {d.id: float(d.score or 0.0) for d in [*result.documents, *result.dropped]}


def compare(reference: list[OptimizeResult], other: list[OptimizeResult]) -> dict[str, Any]:
    """Questions and documents whose kept text differs, and the largest document-score difference."""
    questions = docs = 0
    worst = 0.0
    for a, b in zip(reference, other, strict=True):
        ka, kb = _kept(a), _kept(b)
        changed = sum(ka.get(i) != kb.get(i) for i in set(ka) | set(kb))
        docs += changed
        questions += changed > 0
        sa, sb = _scores(a), _scores(b)
        worst = max([worst, *(abs(sa[i] - sb[i]) for i in sa if i in sb)])
    return {"questions_differing": questions, "documents_differing": docs, "max_score_diff": worst}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from rag_opt.models.threads import ThreadPolicy

    exs = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.questions)
    qs = [ex.question for ex in exs]
    docs = [hotpot_documents(ex, "field")[0] for ex in exs]
    out: dict[str, Any] = {"questions": len(qs), "documents": sum(len(d) for d in docs), "modes": {}}

    def singles(opt: ContextOptimizer) -> list[OptimizeResult]:
        return [opt.optimize(q, d) for q, d in tqdm(list(zip(qs, docs, strict=True)), desc="single", mininterval=10)]

    def batched(opt: ContextOptimizer, share: bool = False) -> list[OptimizeResult]:
        res: list[OptimizeResult] = []
        for a in tqdm(range(0, len(qs), args.batch), desc="batch", mininterval=10):
            res.extend(opt.optimize_batch(qs[a : a + args.batch], docs[a : a + args.batch], share_passes=share))
        return res

    base = ContextOptimizer(ratio=1 / 3, cache=None, threads=1)
    reference = singles(base)
    modes = {
        "batch, no cache": lambda: batched(base),
        "batch sharing passes": lambda: batched(base, share=True),
        "single, cache cold": lambda: singles(ContextOptimizer(ratio=1 / 3, cache=EncodingCache(), threads=1)),
        "batch, cache cold": lambda: batched(ContextOptimizer(ratio=1 / 3, cache=EncodingCache(), threads=1)),
    }
    warm = ContextOptimizer(ratio=1 / 3, cache=EncodingCache(), threads=1)
    modes["batch, then single warm"] = lambda: (batched(warm), singles(warm))[1]
    alone = ContextOptimizer(ratio=1 / 3, cache=EncodingCache(), threads=1)

    def read_alone_first() -> list[OptimizeResult]:
        """The cache filled one document per call (each read in a pass of its own), then the questions, warm."""
        for q, d in zip(qs, docs, strict=True):
            for doc in d:
                alone.optimize(q, [doc])
        return singles(alone)

    modes["single, warm from documents read alone"] = read_alone_first
    two = ContextOptimizer(ratio=1 / 3, cache=None, threads=ThreadPolicy(2))
    modes["single, two threads"] = lambda: singles(two)
    for name, fn in modes.items():
        out["modes"][name] = compare(reference, fn())
        logger.info("%-26s %s", name, out["modes"][name])
    return out


def show(res: dict[str, Any]) -> None:
    logger.info(
        "%d questions, %d documents; against one call each (no cache, one thread):", res["questions"], res["documents"]
    )
    for name, m in res["modes"].items():
        logger.info(
            "  %-26s questions differing %d, documents differing %d, largest score difference %.2e",
            name,
            m["questions_differing"],
            m["documents_differing"],
            m["max_score_diff"],
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="questions per optimize_batch call")
    ap.add_argument("--out", default=str(RESULTS / "determinism.json"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_or_report(Path(args.out), args.report_only, lambda: run(args), show)


if __name__ == "__main__":
    main()
