"""Joint against parallel encoding on the same held-out questions, paired: which one keeps more supporting facts?

Both encodings score every question with their shipped sentence probe on one loaded proxy model (the same
precision), interleaved question by question; selection, segmentation and the target-token budget are the library's
(``ContextOptimizer(scorer=...)``, o200k_base), and BM25 runs alongside as the floor. The differences come with
paired bootstrap 95 % intervals (questions resampled with replacement), so "within 0.005" can be read against the
noise of the sample.

    python benchmarks/encoding_quality.py --hotpot 150 --ratios 1/3,1/5 --dtype bfloat16
        # → benchmarks/results/encoding_quality.json

``--parallel-probe FILE`` scores the parallel arm with another sentence probe than the shipped one; ``--candidate
FILE`` adds a fourth arm, parallel encoding with that probe, compared with the parallel arm (an ablation, e.g.
with and without a feature block, on the same questions).

The questions are the first ``--hotpot`` of HotpotQA dev's seeded shuffle (``read_hotpotqa(seed=0)``, as in
``benchmarks/compression.py``; ``--offset`` skips some first). Metrics as in ``compression.py``: supporting-fact
recall, all facts kept, answer kept (yes/no answers excluded).
"""

from __future__ import annotations

import argparse
import logging
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from common import data_dir, paired_bootstrap, run_or_report
from compression import MemoScorer, hotpot_metrics

from rag_opt.pipeline import ContextOptimizer
from rag_opt.training.datasets import read_hotpotqa

logger = logging.getLogger("bench.encoding_quality")
RESULTS = Path(__file__).resolve().parent / "results"
METRICS = ("sf_recall", "all_facts_kept", "answer_retention")
ARMS = ("joint", "parallel", "bm25")  # and "candidate" with --candidate


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from rag_opt.compressors import BM25Scorer, SentinelCompressor
    from rag_opt.models.loader import load_proxy_model

    ratios = [float(Fraction(r)) for r in args.ratios.split(",")]
    questions = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + args.hotpot)
    questions = questions[args.offset :]
    proxy = load_proxy_model(args.model, dtype=args.dtype)
    scorers = {
        "joint": MemoScorer(SentinelCompressor(proxy, encoding="joint")),
        "parallel": MemoScorer(SentinelCompressor(proxy, args.parallel_probe, encoding="parallel")),
        "bm25": MemoScorer(BM25Scorer()),
    }
    if args.candidate:
        scorers["candidate"] = MemoScorer(SentinelCompressor(proxy, args.candidate, encoding="parallel"))
    all_arms = tuple(scorers)
    optimizers = {arm: ContextOptimizer(scorer=s) for arm, s in scorers.items()}
    rows: dict[str, dict[str, list[dict[str, float | None]]]] = {
        f"{r:.3f}": {arm: [] for arm in all_arms} for r in ratios
    }
    for i, ex in enumerate(tqdm(questions, desc="questions", mininterval=10)):
        docs = [{"id": t, "title": t, "text": ex.paragraph_text(p)} for p, t in enumerate(ex.titles)]
        arms = all_arms[i % 2 :] + all_arms[: i % 2]  # alternate which encoding reads first
        for arm in arms:
            for r in ratios:
                rows[f"{r:.3f}"][arm].append(hotpot_metrics(ex, optimizers[arm].optimize(ex.question, docs, ratio=r)))
    table: dict[str, Any] = {}
    for r, by_arm in rows.items():
        means = {
            arm: {m: float(np.mean([x[m] for x in xs if x[m] is not None])) for m in METRICS}
            for arm, xs in by_arm.items()
        }
        diffs = {
            m: paired_bootstrap([x[m] for x in by_arm["joint"]], [x[m] for x in by_arm["parallel"]]) for m in METRICS
        }
        table[r] = {"means": means, "parallel_minus_joint": diffs}
        if "candidate" in by_arm:
            table[r]["candidate_minus_parallel"] = {
                m: paired_bootstrap([x[m] for x in by_arm["parallel"]], [x[m] for x in by_arm["candidate"]])
                for m in METRICS
            }
    return {
        "questions": len(questions),
        "offset": args.offset,
        "precision": str(proxy.dtype).removeprefix("torch."),
        "probes": {
            arm: {
                "source": str({"candidate": args.candidate, "parallel": args.parallel_probe}.get(arm, "auto")),
                "trained_on": scorers[arm].inner.probe.metadata.get("trained_on"),  # type: ignore[union-attr]
                "blocks": list(scorers[arm].inner.probe.layout.blocks),  # type: ignore[union-attr]
            }
            for arm in all_arms
            if arm != "bm25"
        },
        "ratios": table,
        "per_question": rows,
    }


def show(res: dict[str, Any]) -> None:
    print(f"HotpotQA dev, {res['questions']} questions (offset {res['offset']}), {res['precision']}, paired")
    for arm, probe in res["probes"].items():
        print(f"  {arm}: {probe['source']} ({', '.join(probe['blocks'])}; {probe['trained_on']})")
    print(f"{'ratio':>6} {'metric':<16} {'joint':>7} {'parallel':>9} {'BM25':>7}   parallel − joint [95% CI]")
    for r, t in res["ratios"].items():
        for m in METRICS:
            d = t["parallel_minus_joint"][m]
            print(
                f"{float(r):>6.3f} {m:<16} {t['means']['joint'][m]:>7.3f} {t['means']['parallel'][m]:>9.3f} "
                f"{t['means']['bm25'][m]:>7.3f}   {d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
            )
        if "candidate_minus_parallel" in t:
            for m in METRICS:
                d = t["candidate_minus_parallel"][m]
                print(
                    f"{float(r):>6.3f} {m:<16} candidate {t['means']['candidate'][m]:.3f}, minus parallel "
                    f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hotpot", type=int, default=150, help="HotpotQA dev questions (seeded shuffle)")
    ap.add_argument("--offset", type=int, default=0, help="skip this many questions of the shuffle first")
    ap.add_argument("--ratios", default="1/3,1/5")
    ap.add_argument("--model", default=None)
    ap.add_argument("--parallel-probe", default="auto", help="sentence probe of the parallel arm (default: shipped)")
    ap.add_argument("--candidate", default=None, help="another parallel-encoding probe, compared with that arm")
    ap.add_argument("--dtype", default="bfloat16", help="proxy precision of both arms (the probes' own: bfloat16)")
    ap.add_argument("--out", default=str(RESULTS / "encoding_quality.json"))
    ap.add_argument("--report-only", action="store_true", help="re-print the saved results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not (data_dir() / "hotpotqa" / "dev.jsonl.gz").is_file():
        raise SystemExit(f"HotpotQA dev not found under {data_dir()}: nothing to measure")
    run_or_report(Path(args.out), args.report_only, lambda: run(args), show)


if __name__ == "__main__":
    main()
