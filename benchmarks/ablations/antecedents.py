"""Keeping a back-reference only with its antecedent: what it does to compression quality.

    OMP_NUM_THREADS=1 python benchmarks/ablations/antecedents.py --hotpot 300   # → benchmarks/results/antecedents.json

An English sentence that opens with a back-reference (``It``, ``She``, ``These``, ...) is, by default, kept only
together with the sentence before it (``SelectionOptions.keep_antecedents``), so no kept sentence dangles. On the
first ``--hotpot`` HotpotQA dev questions of the seeded shuffle, both selection rules run on the same scores (the
model tier's scores are computed once per question and reused; the lexical tier too), at 1/3 and 1/5, and the
paired differences (with the rule minus without) come with 95 % bootstrap intervals.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir, paired_bootstrap  # noqa: E402
from compression import MemoScorer, hotpot_metrics  # noqa: E402

from rag_opt.compressors import SentinelCompressor  # noqa: E402
from rag_opt.models.loader import load_proxy_model  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.training.datasets import read_hotpotqa  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
METRICS = ("sf_recall", "all_facts_kept", "answer_retention")


def run(args: argparse.Namespace) -> dict[str, Any]:
    qs = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.hotpot)
    scorer = MemoScorer(SentinelCompressor(load_proxy_model(None, dtype="bfloat16"), encoding="parallel"))
    tiers = {
        "model": {mode: ContextOptimizer(scorer=scorer, keep_antecedents=mode) for mode in (False, True)},
        "lexical": {mode: ContextOptimizer(tier="lexical", keep_antecedents=mode) for mode in (False, True)},
    }
    rows: dict[str, list[dict[str, float | None]]] = {}
    for ex in qs:
        docs = [{"id": t, "title": t, "text": ex.paragraph_text(p)} for p, t in enumerate(ex.titles)]
        for tier, opts in tiers.items():
            for r in (1 / 3, 1 / 5):
                for mode, opt in opts.items():
                    res = opt.optimize(ex.question, docs, ratio=r)
                    rows.setdefault(f"{tier} {r:.3f} {mode}", []).append(hotpot_metrics(ex, res))
    out: dict[str, Any] = {"questions": len(qs), "results": {}}
    for tier in tiers:
        for r in (1 / 3, 1 / 5):
            off, on = rows[f"{tier} {r:.3f} False"], rows[f"{tier} {r:.3f} True"]
            out["results"][f"{tier} {r:.3f}"] = {
                m: {
                    "without": float(np.mean([x[m] for x in off if x[m] is not None])),
                    "with": float(np.mean([x[m] for x in on if x[m] is not None])),
                    **paired_bootstrap([x[m] for x in off], [x[m] for x in on]),
                }
                for m in METRICS
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hotpot", type=int, default=300)
    ap.add_argument("--out", default=str(RESULTS / "antecedents.json"))
    args = ap.parse_args()
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    for key, by_metric in res["results"].items():
        cells = [
            f"{m} {v['without']:.3f} -> {v['with']:.3f} ({v['diff']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}])"
            for m, v in by_metric.items()
        ]
        print(key, " | ".join(cells))


if __name__ == "__main__":
    main()
