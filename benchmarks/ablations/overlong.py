"""Overlong units: what one unpunctuated "sentence" costs next to the same words in ordinary sentences.

    python benchmarks/ablations/overlong.py --words 8000          # → benchmarks/results/overlong.json

Two arms, interleaved, on the embedded proxy model (joint encoding, the default), one document each:

* **sentences** (the baseline): ``--words`` words of real HotpotQA dev prose, with its own punctuation;
* **one unit**: the same words with every sentence-ending mark and line break removed, so the segmenter finds one
  ``sentence`` of the whole text (the stall of issue 21, defect 6).

Reported per arm: the median optimization time over ``--repeat`` runs, the units the document was cut into, the
largest unit in target tokens, the proxy's forward-pass windows, and the tokens kept at ``--ratio``; then the
ratio one unit / sentences of the medians. With units bounded at a token limit both arms cost about the same and
both keep text; before, the one unit was read in one window of its own (quadratic attention) and, bigger than
any budget, dropped whole.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import data_dir, run_or_report

from rag_opt.pipeline import ContextOptimizer

RESULTS = Path(__file__).resolve().parents[1] / "results"
logger = logging.getLogger("bench.overlong")
QUESTION = "Which city was the band formed in?"


def prose(words: int) -> str:
    """The first ``words`` words of HotpotQA dev paragraphs, joined (real punctuation)."""
    out: list[str] = []
    with gzip.open(data_dir() / "hotpotqa" / "dev.jsonl.gz", "rt") as fh:
        for line in fh:
            for _title, sents in json.loads(line)["context"]:
                out.extend("".join(sents).split())
                if len(out) >= words:
                    return " ".join(out[:words])
    return " ".join(out)


def one_unit(text: str) -> str:
    """``text`` with no sentence boundary left: terminal marks become commas, line breaks spaces."""
    return re.sub(r"[.!?…]", ",", text.replace("\n", " "))


def run(args: argparse.Namespace) -> dict[str, Any]:
    opt = ContextOptimizer(threads=args.threads)
    opt.optimize("Warm up?", ["A short document. It has two sentences."], ratio=0.5)
    base = prose(args.words)
    arms = {"sentences": base, "one unit": one_unit(base)}
    times: dict[str, list[float]] = {k: [] for k in arms}
    info: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeat):
        for name, text in arms.items():
            t = time.perf_counter()
            r = opt.optimize(QUESTION, [text], ratio=args.ratio)
            times[name].append(time.perf_counter() - t)
            doc = (r.documents or r.dropped)[0]
            info[name] = {
                "chars": len(text),
                "tokens_before": r.tokens_before,
                "tokens_after": r.tokens_after,
                "units": len(doc.units),
                "largest_unit_tokens": max(u.tokens for u in doc.units),
            }
            logger.info("%s: %.1f s, %s", name, times[name][-1], info[name])
    out: dict[str, Any] = {"words": args.words, "ratio": args.ratio, "repeat": args.repeat, "arms": {}}
    for name in arms:
        out["arms"][name] = {**info[name], "median_s": statistics.median(times[name]), "runs_s": times[name]}
    out["one_unit_over_sentences"] = out["arms"]["one unit"]["median_s"] / out["arms"]["sentences"]["median_s"]
    return out


def show(res: dict[str, Any]) -> None:
    print(f"{res['words']} words, ratio {res['ratio']}, median of {res['repeat']}")
    print(f"{'arm':<10} {'median s':>9} {'units':>6} {'largest':>8} {'before':>7} {'after':>6}")
    for name, a in res["arms"].items():
        print(
            f"{name:<10} {a['median_s']:>9.2f} {a['units']:>6} {a['largest_unit_tokens']:>8} "
            f"{a['tokens_before']:>7} {a['tokens_after']:>6}"
        )
    print(f"one unit / sentences (median time): {res['one_unit_over_sentences']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", type=int, default=8000)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "overlong.json"))
    ap.add_argument("--report-only", action="store_true", help="show the saved results without running")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_or_report(Path(args.out), args.report_only, lambda: run(args), show)


if __name__ == "__main__":
    main()
