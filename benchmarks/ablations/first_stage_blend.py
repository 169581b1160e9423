"""Does averaging the two first stages help? The network and the logistic probe's held-out logits, alone and averaged.

    OMP_NUM_THREADS=2 python benchmarks/ablations/first_stage_blend.py  # → results/first_stage_blend.json, ~10 min

The parallel encoding's shipped first stage is a network of one hidden layer with the lexical features around it;
on held-out train questions it compresses as well as the logistic probe it replaced (``context_reselect.py``). Two
models of about equal quality that err differently often gain when averaged. This script asks, without touching
dev: the shipped probe's training rows get 5-fold held-out logits from both first stages (``context_reselect.py``'s
``held_out_logits``), a third set is their mean, and each set gets the shipped second stage (``own`` +
``named_by_other``) fitted on four fifths of the questions and compresses the held-out fifth's HotpotQA questions
at 1/3 and 1/5 (``context_reselect.py``'s ``measure``). Paired against the network, 95 % bootstrap intervals over
the 4,445 questions.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ablations/
from common import paired_bootstrap  # noqa: E402
from context_reselect import RATIOS, SHIPPED, held_out_logits, measure, selection_tables  # noqa: E402
from probe_capacity import training_set  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
logger = logging.getLogger("first_stage_blend")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nq", type=int, default=806, help="NQ train contexts of 10 documents (default 806)")
    ap.add_argument("--out", type=Path, default=RESULTS / "first_stage_blend.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tables: list[Any] = []
    examples, layout, X, y, g, _ = training_set(args.nq, tables)
    z = {stage: held_out_logits(X, y, g, layout, stage) for stage in ("network", "logistic")}
    z["blend"] = (z["network"] + z["logistic"]) / 2
    del X
    sel = selection_tables(examples)
    runs = {name: measure(SHIPPED, examples, tables, sel, logits, y) for name, logits in z.items()}
    res: dict[str, Any] = {"questions": len(examples), "second_stage": list(SHIPPED), "first_stages": {}}
    print(f"{len(examples)} held-out HotpotQA train questions; recall / answer kept; change against the network")
    for name, o in runs.items():
        cells: dict[str, Any] = {}
        line = f"{name:<9}"
        for r in RATIOS:
            cell: dict[str, Any] = {}
            for m in ("recall", "answer"):
                both = ~np.isnan(runs["network"][r][m])
                d = paired_bootstrap(list(runs["network"][r][m][both]), list(o[r][m][both]))
                cell[m] = float(np.nanmean(o[r][m]))
                cell[f"{m}_diff"] = [d["diff"], d["low"], d["high"]]
                line += f"  1/{round(1 / r)} {m} {cell[m]:.4f} {d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"
            cells[f"1/{round(1 / r)}"] = cell
        res["first_stages"][name] = cells
        print(line, flush=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
