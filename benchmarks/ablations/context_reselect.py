"""The second stage's features chosen again for parallel encoding, measured at 1/3 and 1/5 on held-out train questions.

    OMP_NUM_THREADS=2 python benchmarks/ablations/context_reselect.py [--first-stage network|logistic]
        # → results/context_reselect_<first stage>.json, ~10 min

The shipped second stage (``own`` + ``named_by_other``) was chosen in the joint encoding, at 1/3, on dev questions
200–400 (``context_ablation.py``). This script asks again with the parallel encoding's features, at both budgets,
without touching dev: the shipped probe's training rows (HotpotQA train, 4,445 questions, and 806 NQ contexts, from
the feature caches ``rag-opt train-probe --encoding parallel --layers 16 --dtype bfloat16 --nq 806`` fills) get
5-fold held-out first-stage logits (the shipped recipe: a network of one hidden layer with the lexical block around
it, or ``--first-stage logistic``); each candidate second stage is then fitted on four fifths of the questions (other
folds than the first stage's) and scores the held-out fifth, whose HotpotQA questions are compressed by the
library's selection at 1/3 and 1/5 of their o200k tokens (HotpotQA's own sentences, as ``probe_ablation.py``).
Every candidate adds one feature to the shipped pair; each is paired question by question against the pair (95 %
bootstrap intervals over all 4,445 questions).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ablations/: probe_capacity.py
from common import paired_bootstrap  # noqa: E402
from probe_capacity import training_set  # noqa: E402  (the shipped parallel probe's rows, from the caches)

RESULTS = Path(__file__).resolve().parents[1] / "results"
RATIOS = (1 / 3, 1 / 5)
SHIPPED = ("own", "named_by_other")
logger = logging.getLogger("context_reselect")


def held_out_logits(X: np.ndarray, y: np.ndarray, g: np.ndarray, layout: Any, first_stage: str) -> np.ndarray:
    """5-fold held-out first-stage logits (folds by question), as ``fit_probe`` computes them for its second stage."""
    from rag_opt.training.logistic import cross_val_scores
    from rag_opt.training.mlp import MLPConfig, cross_val_mlp_scores

    if first_stage == "logistic":
        return cross_val_scores(X, y, g, l2=1e-3, folds=5, seed=0)
    config = MLPConfig()
    return cross_val_mlp_scores(X, y, g, config, folds=5, seed=0, linear_columns=layout.columns(config.linear_blocks))


def selection_tables(examples: list[Any]) -> list[Any]:
    """Each HotpotQA example's paragraphs as the selection reads them (its own sentences, titles counted)."""
    from rag_opt.text.tokens import get_token_counter
    from rag_opt.text.units import UnitTable
    from rag_opt.types import Document

    count = get_token_counter("o200k_base").count
    out = []
    for ex in examples:
        docs = [Document(text=ex.paragraph_text(p), title=t) for p, t in enumerate(ex.titles)]
        bounds = [np.cumsum([0] + [len(s) for s in sents]) for sents in ex.sentences]
        spans = [[(int(b[i]), int(b[i + 1])) for i in range(len(b) - 1)] for b in bounds]
        out.append(UnitTable.from_spans(docs, spans, count))
    return out


def measure(
    names: tuple[str, ...], examples: list[Any], tables: list[Any], sel: list[Any], z: np.ndarray, y: np.ndarray
) -> dict[float, dict[str, np.ndarray]]:
    """Per HotpotQA question and budget: supporting-fact recall and answer kept, the second stage over ``names``
    fitted on the other folds' questions (``("own",)``: the first stage alone)."""
    from rag_opt.compressors.selection import select
    from rag_opt.text.tokens import get_token_counter
    from rag_opt.training.datasets import contains_answer
    from rag_opt.training.logistic import question_folds
    from rag_opt.training.sentence_probe import fit_context_stage

    count = get_token_counter("o200k_base").count
    starts = np.cumsum([0] + [int(t.candidate.sum()) for t in tables])
    n_hot = len(examples)
    out = {r: {"recall": np.full(n_hot, np.nan), "answer": np.full(n_hot, np.nan)} for r in RATIOS}
    for held in question_folds(np.arange(len(tables)), folds=5, seed=1):
        train = np.flatnonzero(~held)
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in train])
        stage = fit_context_stage([tables[i] for i in train], z[rows], y[rows], names) if names != ("own",) else None
        for i in np.flatnonzero(held[:n_hot]):
            units, ex, u = tables[i], examples[i], sel[i]
            logits = np.zeros(units.n_units)
            logits[units.candidate] = z[starts[i] : starts[i + 1]]
            scores = stage.decision(logits, units) if stage is not None else logits
            for r in RATIOS:
                keep = select(u, scores, count, limit=int(r * u.tokens_before)).keep & u.candidate
                kept = {(int(u.doc[k]), int(k - u.bounds[u.doc[k]] - 1)) for k in np.flatnonzero(keep)}
                if ex.supporting:
                    out[r]["recall"][i] = np.mean([s in kept for s in ex.supporting])
                if not ex.yes_no:
                    text = " ".join(ex.sentences[p][s] for p, s in sorted(kept))
                    out[r]["answer"][i] = float(contains_answer(text, ex.answer))
    return out


def main() -> None:
    from rag_opt.compressors.context_features import CONTEXT_FEATURES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--first-stage", choices=("network", "logistic"), default="network")
    ap.add_argument("--nq", type=int, default=806, help="NQ train contexts of 10 documents (default 806)")
    ap.add_argument("--out", type=Path, default=None, help="default results/context_reselect_<first stage>.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tables: list[Any] = []
    examples, layout, X, y, g, _ = training_set(args.nq, tables)
    z = held_out_logits(X, y, g, layout, args.first_stage)
    del X
    sel = selection_tables(examples)
    variants = [("own",), SHIPPED] + [(*SHIPPED, n) for n in CONTEXT_FEATURES if n not in SHIPPED]
    runs = {v: measure(v, examples, tables, sel, z, y) for v in variants}
    res: dict[str, Any] = {"first_stage": args.first_stage, "questions": len(examples), "variants": {}}
    shipped = "+".join(SHIPPED)
    print(f"{len(examples)} held-out HotpotQA train questions; recall / answer kept; change against {shipped}")
    for v, o in runs.items():
        key, cells = "+".join(v), {}
        line = f"{key:<36}"
        for r in RATIOS:
            means = {m: float(np.nanmean(o[r][m])) for m in ("recall", "answer")}
            cell: dict[str, Any] = dict(means)
            line += f"  1/{round(1 / r)} {means['recall']:.4f} / {means['answer']:.4f}"
            if v != SHIPPED:
                for m in ("recall", "answer"):
                    both = ~np.isnan(runs[SHIPPED][r][m])
                    d = paired_bootstrap(list(runs[SHIPPED][r][m][both]), list(o[r][m][both]))
                    cell[f"{m}_diff"] = [d["diff"], d["low"], d["high"]]
                    line += f" {d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"
            cells[f"1/{round(1 / r)}"] = cell
        res["variants"][key] = cells
        print(line, flush=True)
    out = args.out or RESULTS / f"context_reselect_{args.first_stage}.json"
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
