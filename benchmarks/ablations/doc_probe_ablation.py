"""Which features make the document relevance probe? Cross-validated on the NQ ``train`` split only.

For each feature set, a logistic-regression document probe is fitted and scored 5-fold (folds split by
question) on NQ training questions rendered with N documents, the gold passage at a random slot. Reported:
gold Recall@1 / Recall@3 overall and Recall@3 by gold-position third (first / middle / last slots), plus BM25
and raw attention (mean over heads) on the same instances. Features come from the cache that
``rag-opt train-doc-probe`` fills (run it first); profiles from the calibration store.

    python benchmarks/ablations/doc_probe_ablation.py --n-docs 20 --limit 250
    # → benchmarks/results/doc_probe_ablation.json
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
from common import data_dir

from rag_opt.artifacts.position_profiles import ProfileStore
from rag_opt.compressors.features import FeatureLayout
from rag_opt.compressors.lexical import bm25_scores
from rag_opt.models.loader import load_proxy_model
from rag_opt.models.prompt import VIEWS
from rag_opt.paths import cache_dir
from rag_opt.training.doc_probe import (
    build_doc_training_set,
    cross_val_scores,
    grouped_recall,
    nq_cache,
)
from rag_opt.training.nq_contexts import nq_records, random_positions
from rag_opt.training.sentence_probe import choose_l2

RESULTS = Path(__file__).resolve().parents[1] / "results"
FEATURE_SETS = {
    "calibrated last": ("doc_cal_last",),
    "calibrated question": ("doc_cal_question",),
    "calibrated last + question": ("doc_cal_last", "doc_cal_question"),
    "log-ratio calibrated last + question (shipped)": ("doc_ratio_last", "doc_ratio_question"),
    "calibrated (difference) last + question + lexical": ("doc_cal_last", "doc_cal_question", "doc_lexical"),
    "log-ratio calibrated + lexical": ("doc_ratio_last", "doc_ratio_question", "doc_lexical"),
    "raw last + question (no calibration)": ("doc_raw_last", "doc_raw_question"),
    "raw last + question + lexical": ("doc_raw_last", "doc_raw_question", "doc_lexical"),
    "lexical only": ("doc_lexical",),
}


def by_third(scores: np.ndarray, y: np.ndarray, groups: np.ndarray, gold_pos: np.ndarray, n: int) -> list[float]:
    out = []
    for lo, hi in ((0, n // 3), (n // 3, n - n // 3), (n - n // 3, n)):
        m = np.isin(groups, np.unique(groups[(gold_pos >= lo) & (gold_pos < hi)]))
        out.append(grouped_recall(scores[m], y[m], groups[m], 3) if m.any() else float("nan"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-docs", type=int, default=20)
    ap.add_argument("--limit", type=int, default=250)
    ap.add_argument("--cache", default=str(cache_dir() / "features"))
    ap.add_argument("--store", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "doc_probe_ablation.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    proxy = load_proxy_model(None)
    prof = ProfileStore(args.store).get(proxy.name, args.n_docs)
    if prof is None:
        sys.exit(f"no calibration profile for {args.n_docs} documents: run `rag-opt calibrate --n-docs {args.n_docs}`")
    recs = nq_records(data_dir() / "nq_multidoc" / "public.jsonl.gz", "train")[: args.limit]
    insts = random_positions(recs, args.n_docs, seed=args.seed)
    feats = nq_cache(args.cache, proxy.name, "train", args.n_docs).load(i.id for i in insts)
    insts = [i for i in insts if i.id in feats]
    if not insts:
        sys.exit("no cached training features: run `rag-opt train-doc-probe` (or the extraction) first")
    profiles = {args.n_docs: prof}
    n = args.n_docs
    results: dict[str, dict[str, Any]] = {}
    base_lay = FeatureLayout(("doc_lexical",), proxy.num_layers, proxy.num_heads, level="document")
    _, y, groups = build_doc_training_set(insts, feats, base_lay, profiles)
    gold_pos = np.repeat([i.gold_at for i in insts], n)

    def record(name: str, scores: np.ndarray, extra: dict[str, Any] | None = None) -> None:
        results[name] = {
            "recall@1": grouped_recall(scores, y, groups, 1),
            "recall@3": grouped_recall(scores, y, groups, 3),
            "recall@3_by_third": by_third(scores, y, groups, gold_pos, n),
            **(extra or {}),
        }

    bm = np.concatenate([bm25_scores(i.example.question, ["".join(u) for u in i.units()]) for i in insts])
    record("BM25", bm)
    last = VIEWS.index("last")
    raw = [feats[i.id].doc_mass[:, last].mean(axis=(1, 2)) for i in insts]
    record("raw attention (mean over heads)", np.concatenate(raw))
    for name, blocks in FEATURE_SETS.items():
        lay = FeatureLayout(blocks, proxy.num_layers, proxy.num_heads, level="document")
        X, _, _ = build_doc_training_set(insts, feats, lay, profiles)
        l2, _ = choose_l2(X, y, groups, grid=(1e-2, 3e-2, 1e-1, 3e-1, 1.0), seed=args.seed)
        out = cross_val_scores(X, y, groups, l2=l2, seed=args.seed)
        record(name, out, {"l2": l2, "features": int(X.shape[1])})
        logging.warning("%s: %s", name, results[name])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"n_docs": n, "questions": len(insts), "results": results}, indent=2))
    print(f"NQ train, {n} documents, {len(insts)} questions (gold at a random slot), 5-fold by question")
    print(f"{'features':<48}{'R@1':>6}{'R@3':>6}   R@3 by gold third (first/middle/last)")
    for name, r in results.items():
        thirds = " / ".join(f"{x:.2f}" for x in r["recall@3_by_third"])
        print(f"{name:<48}{r['recall@1']:>6.2f}{r['recall@3']:>6.2f}   {thirds}")


if __name__ == "__main__":
    main()
