"""What the opt-in second reading costs and what it does to compression (``SentinelCompressor(passes=2)``).

``passes=2`` reads each context a second time with its documents reversed and merges both readings (log-odds
mean; ``rag_opt.compressors.document_orders``). Its point is document relevance in the first slots of long contexts
(``benchmarks/position.py --two-readings 10,20,30``); this benchmark checks the other side on HotpotQA dev (the
first ``--hotpot`` questions of the seeded shuffle, as ``compression.py``): sentence selection at 1/3 and 1/5
through the same pipeline, and the optimize time of one and two readings, interleaved question by question (the
order alternates), so the ratio of medians is measured under the same load.

    OMP_NUM_THREADS=1 python benchmarks/ablations/two_readings.py --hotpot 100  # → benchmarks/results/two_readings.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import data_dir
from compression import MemoScorer, hotpot_metrics, summarize

from rag_opt.pipeline import ContextOptimizer
from rag_opt.training.datasets import read_hotpotqa

RESULTS = Path(__file__).resolve().parents[1] / "results"
RATIOS = (1 / 3, 1 / 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hotpot", type=int, default=100, help="HotpotQA dev questions (seeded shuffle prefix)")
    ap.add_argument("--out", default=str(RESULTS / "two_readings.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = data_dir() / "hotpotqa" / "dev.jsonl.gz"
    if not path.is_file():
        raise SystemExit(f"HotpotQA not found at {path}: this benchmark needs ../shared/data (see its README)")
    from tqdm.auto import tqdm

    from rag_opt.compressors import SentinelCompressor

    one = SentinelCompressor.from_model()
    two = SentinelCompressor(one.proxy, one.probe, doc_probe=one.doc_probe, profiles=one.profiles, passes=2)
    memo = {"one reading (default)": MemoScorer(one), "two readings (passes=2)": MemoScorer(two)}
    opts = {name: ContextOptimizer(scorer=m) for name, m in memo.items()}
    rows: dict[str, dict[float, list[dict[str, float | None]]]] = {n: {r: [] for r in RATIOS} for n in memo}
    ms: dict[str, list[float]] = {n: [] for n in memo}
    examples = read_hotpotqa(path, seed=0, limit=args.hotpot)
    for i, ex in enumerate(tqdm(examples, desc="questions", mininterval=10)):
        docs = [{"id": t, "title": t, "text": ex.paragraph_text(p)} for p, t in enumerate(ex.titles)]
        names = list(memo) if i % 2 == 0 else list(memo)[::-1]  # alternate which goes first
        for name in names:
            for r in RATIOS:
                t0 = time.perf_counter()
                res = opts[name].optimize(ex.question, docs, ratio=r)
                if r == RATIOS[0]:
                    ms[name].append((time.perf_counter() - t0) * 1e3)
                rows[name][r].append(hotpot_metrics(ex, res))
    base, other = list(memo)
    results: dict[str, Any] = {
        "hotpot_questions": len(examples),
        "quality": {n: {f"{r:.3f}": summarize(rows[n][r]) for r in RATIOS} for n in memo},
        "median_optimize_ms": {n: statistics.median(v) for n, v in ms.items()},
        "median_per_question_ratio": statistics.median(b / a for a, b in zip(ms[base], ms[other], strict=True)),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"HotpotQA dev, {len(examples)} questions: recall / all facts kept / answer kept / achieved ratio")
    for n in memo:
        for r in RATIOS:
            q = results["quality"][n][f"{r:.3f}"]
            print(
                f"  {n:<26} 1/{round(1 / r)}: {q['sf_recall']:.3f} / {q['all_facts_kept']:.3f} / "
                f"{q['answer_retention']:.3f} / {q['ratio']:.3f}"
            )
    med = results["median_optimize_ms"]
    print(
        f"median optimize: {med[base]:.0f} ms vs {med[other]:.0f} ms "
        f"(per-question ratio, median: {results['median_per_question_ratio']:.2f}×)"
    )


if __name__ == "__main__":
    main()
