"""Taking sentences by score per token instead of by score: what it does under a tight budget.

    OMP_NUM_THREADS=1 python benchmarks/ablations/density.py --select 200:400 --alphas 0,0.25,0.5,1
        # → benchmarks/results/density_model.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/density.py --tier lexical        # → .../density_lexical.json

The select stage takes candidate sentences best score first. Under a tight budget a long sentence with a high
score can cost the room of two shorter ones that, together, hold more supporting facts: the knapsack view ranks a
sentence by its score over its cost in target tokens, ``score / tokens ** alpha`` (``alpha = 0``: today's rule,
``1``: pure density). The probe's scores are probabilities, so the ranking is an expected number of facts per
token.

The tier's scores (``--tier model``: parallel encoding and the shipped probes; ``lexical``: the lexical probe) are
computed once per question, and every ranking
is applied to the same scores through the library's own selection (``ContextOptimizer(scorer=...)``), at 1/3 and
1/5, with the title field and without any title. Questions: the HotpotQA dev slice ``--select`` of the seeded
shuffle (default 200–400: not the README's benchmark questions, which are the first 200). Paired differences
against ``alpha = 0`` come with 95 % bootstrap intervals.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir, paired_bootstrap  # noqa: E402
from compression import MemoScorer, hotpot_documents, hotpot_metrics  # noqa: E402

from rag_opt.compressors import SentinelCompressor  # noqa: E402
from rag_opt.compressors.base import Scores  # noqa: E402
from rag_opt.compressors.lexical_scorer import LexicalScorer  # noqa: E402
from rag_opt.models.loader import load_proxy_model  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.text.units import UnitTable  # noqa: E402
from rag_opt.training.datasets import read_hotpotqa  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
METRICS = ("sf_recall", "all_facts_kept", "answer_retention")
RATIOS = (1 / 3, 1 / 5)
logger = logging.getLogger("bench.density")


class DensityScorer:
    """The memoised scores, each unit's divided by its target-token cost to the power ``alpha``."""

    def __init__(self, memo: MemoScorer, alpha: float) -> None:
        self.memo = memo
        self.alpha = alpha

    def score(self, question: str, units: UnitTable) -> Scores:
        s = self.memo.score(question, units)
        if not self.alpha:
            return s
        if float(np.min(s.unit)) < 0:
            raise SystemExit("the probe's unit scores are not probabilities: a density ranking needs scores >= 0")
        cost = np.maximum(np.asarray(units.tokens, dtype=np.float64), 1.0)
        return replace(s, unit=np.asarray(s.unit, dtype=np.float64) / cost**self.alpha)


def _slice(spec: str) -> tuple[int, int]:
    a, _, b = spec.partition(":")
    return int(a), int(b)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    a, b = args.select
    qs = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=b)[a:b]
    alphas = [float(x) for x in args.alphas.split(",")]
    if 0.0 not in alphas:
        alphas.insert(0, 0.0)
    inner = (
        LexicalScorer()
        if args.tier == "lexical"
        else SentinelCompressor(load_proxy_model(None, dtype="bfloat16"), encoding="parallel")
    )
    memo = MemoScorer(inner)
    opts = {al: ContextOptimizer(scorer=DensityScorer(memo, al)) for al in alphas}
    rows: dict[str, list[dict[str, float | None]]] = {}
    for ex in tqdm(qs, desc="density", unit="q"):
        for titles in args.titles.split(","):
            docs, shifts = hotpot_documents(ex, titles)
            for r in RATIOS:
                for al, opt in opts.items():
                    res = opt.optimize(ex.question, docs, ratio=r)
                    rows.setdefault(f"{titles} {r:.3f} {al}", []).append(hotpot_metrics(ex, res, shifts))
    out: dict[str, Any] = {
        "tier": args.tier,
        "select": f"{a}:{b}",
        "questions": len(qs),
        "alphas": alphas,
        "results": {},
    }
    for titles in args.titles.split(","):
        for r in RATIOS:
            base = rows[f"{titles} {r:.3f} 0.0"]
            cell: dict[str, Any] = {}
            for al in alphas:
                got = rows[f"{titles} {r:.3f} {al}"]
                cell[str(al)] = {
                    m: {
                        "mean": float(np.mean([x[m] for x in got if x[m] is not None])),
                        **({} if al == 0 else paired_bootstrap([x[m] for x in base], [x[m] for x in got])),
                    }
                    for m in METRICS
                }
            out["results"][f"{titles} {r:.3f}"] = cell
    return out


def show(res: dict[str, Any]) -> None:
    print(
        f"{res['tier']} tier, HotpotQA dev {res['select']} ({res['questions']} questions): "
        "recall / all kept / answer kept"
    )
    for key, cell in res["results"].items():
        for al, by_metric in cell.items():
            means = " / ".join(f"{by_metric[m]['mean']:.3f}" for m in METRICS)
            diffs = (
                ""
                if float(al) == 0
                else "   vs alpha 0: "
                + ", ".join(f"{m} {v['diff']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}]" for m, v in by_metric.items())
            )
            print(f"  {key} alpha {al}: {means}{diffs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--select", type=_slice, default=(200, 400), help="HotpotQA dev slice a:b of the seeded shuffle")
    ap.add_argument("--alphas", default="0,0.25,0.5,1", help="cost exponents to compare (0 is always included)")
    ap.add_argument("--titles", default="field,none", help="title regimes: field, none, text")
    ap.add_argument("--tier", default="model", choices=("model", "lexical"))
    ap.add_argument("--out", default=None, help="results JSON (default results/density_<tier>.json)")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out or RESULTS / f"density_{args.tier}.json")
    res = json.loads(out.read_text()) if args.report_only else run(args)
    if not args.report_only:
        out.write_text(json.dumps(res, indent=1) + "\n")
    show(res)


if __name__ == "__main__":
    main()
