"""Is the sentence probe's first stage too simple? Logistic regression against small networks and boosted trees.

    OMP_NUM_THREADS=1 python benchmarks/ablations/probe_capacity.py      # → results/probe_capacity.json, ~12 min

The rows are the shipped parallel probe's training set (HotpotQA train, 4,445 questions, and 806 NQ train contexts
of 10 documents; parallel encoding, the first 16 layers in bf16, the shipped blocks with cross-document attention),
read from the feature caches that ``rag-opt train-probe --encoding parallel --layers 16 --dtype bfloat16 --nq 806``
fills. 20 % of the questions are held out (the split ``choose_l2`` uses) and every model is fit on the rest:

* logistic regression at L2 strengths down to 1e-4 (the shipped probe's grid stops at 1e-3, the value it chose);
* networks of one hidden layer (:mod:`rag_opt.training.mlp`): widths 16–128, 3 seeds each and their average;
* histogram gradient-boosted trees (scikit-learn, when installed).

Measured on the held-out HotpotQA questions: log-loss, R-precision (the share of a question's positive sentences
among its top-k, k its number of positives) and recall at 4 (the positives among its 4 best sentences), the
ranking that a tight budget keeps. Training questions only: dev stays unseen (the dev figures come from
``benchmarks/compression.py`` with the probe this chooses).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import data_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
logger = logging.getLogger("probe_capacity")


def training_rows(nq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(X, y, groups, HotpotQA rows) of the shipped parallel probe's training set, from the feature caches."""
    _, _, X, y, g, n_hotpot = training_set(nq)
    return X, y, g, n_hotpot


def training_set(
    nq: int, tables: list[Any] | None = None
) -> tuple[list[Any], Any, np.ndarray, np.ndarray, np.ndarray, int]:
    """(HotpotQA examples, layout, X, y, groups, HotpotQA rows) of the shipped parallel probe's training set, from
    the feature caches; ``tables``: a list to append the unit table of every context to (HotpotQA, then NQ)."""
    from rag_opt.compressors.features import DEFAULT_BLOCKS, FeatureLayout
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.paths import cache_dir
    from rag_opt.training.datasets import read_hotpotqa
    from rag_opt.training.nq_contexts import nq_records, random_positions
    from rag_opt.training.nq_sentences import build_nq_training_set
    from rag_opt.training.sentence_probe import build_training_set, feature_store, hotpot_store_name

    data = data_dir() / "hotpotqa" / "train.jsonl.gz"
    nq_data = data_dir() / "nq_multidoc" / "public.jsonl.gz"
    if not data.exists() or not nq_data.exists():
        raise SystemExit(f"HotpotQA or NQ multi-doc data not found under {data_dir()}: nothing to measure")
    proxy = load_proxy_model(None, dtype="bfloat16")
    layout = FeatureLayout(DEFAULT_BLOCKS, 16, proxy.num_heads)
    root = cache_dir() / "features"
    store = feature_store(root, proxy, hotpot_store_name(data, cross=True), 16, "parallel")
    cached = store.ids()
    examples = [ex for ex in read_hotpotqa(data, seed=0) if ex.id in cached]
    instances = random_positions(nq_records(nq_data, "train")[:nq], 10, seed=0)
    nq_store = feature_store(root, proxy, "nq-train-n10-cross", 16, "parallel")
    nq_features = nq_store.load(i.id for i in instances)
    if not examples or len(nq_features) < len(instances):
        raise SystemExit(
            "the parallel training features are not cached: run `rag-opt train-probe --encoding parallel --layers 16 "
            f"--dtype bfloat16 --nq {nq} --out probe.json` first"
        )
    X, y, g = build_training_set(examples, store.load(ex.id for ex in examples), layout, tables=tables)
    Xn, yn, gn = build_nq_training_set(instances, nq_features, layout, group_offset=int(g.max()) + 1, tables=tables)
    return examples, layout, np.concatenate([X, Xn]), np.concatenate([y, yn]), np.concatenate([g, gn]), len(y)


def held_out_metrics(z: np.ndarray, y: np.ndarray, g: np.ndarray, hotpot: np.ndarray) -> dict[str, float]:
    """Log-loss over every held-out row; R-precision and recall at 4 over the held-out HotpotQA questions."""
    p = 1 / (1 + np.exp(-np.clip(z, -30, 30)))
    loss = float(-np.mean(y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12)))
    r_prec, at4 = [], []
    for q in np.unique(g[hotpot]):
        rows = g == q
        labels, order = y[rows], np.argsort(-z[rows], kind="stable")
        k = int(labels.sum())
        if k:
            r_prec.append(labels[order[:k]].sum() / k)
            at4.append(labels[order[:4]].sum() / k)
    return {"logloss": loss, "r_precision": float(np.mean(r_prec)), "recall_at_4": float(np.mean(at4))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rag_opt.training.logistic import train_logistic
    from rag_opt.training.mlp import MLPConfig, train_mlp

    X, y, g, n_hotpot = training_rows(args.nq)
    rng = np.random.default_rng(0)  # the split of rag_opt.training.sentence_probe.choose_l2
    questions = np.unique(g)
    held_q = set(rng.choice(questions, size=max(1, len(questions) // 5), replace=False).tolist())
    held = np.array([q in held_q for q in g])
    hotpot = (np.arange(len(y)) < n_hotpot)[held]
    out: dict[str, Any] = {"rows": int(len(y)), "held_out_rows": int(held.sum()), "models": {}}

    def record(name: str, z: np.ndarray, seconds: float) -> None:
        m = held_out_metrics(z[held], y[held], g[held], hotpot)
        out["models"][name] = {**m, "fit_seconds": round(seconds, 1)}
        logger.info("%-28s log-loss %.4f  R-precision %.4f  recall@4 %.4f", name, *m.values())

    for l2 in (1e-4, 3e-4, 1e-3, 1e-2):
        t = time.perf_counter()
        mean, scale, w, b = train_logistic(X[~held], y[~held], l2=l2)
        record(f"logistic l2={l2:g}", ((X - mean) / scale) @ w + b, time.perf_counter() - t)
    for hidden, dropout in ((16, 0.0), (32, 0.1), (64, 0.2), (128, 0.3)):
        t = time.perf_counter()
        config = MLPConfig(hidden=hidden, members=1, dropout=dropout)
        members = [train_mlp(X[~held], y[~held], config, seed=s) for s in range(3)]
        seconds = (time.perf_counter() - t) / 3
        for s, net in enumerate(members):
            record(f"mlp {hidden} seed {s}", net.decision(X), seconds)
        record(f"mlp {hidden} x3", np.mean([net.decision(X) for net in members], axis=0), 3 * seconds)
    try:
        from sklearn.ensemble import HistGradientBoostingClassifier
    except ImportError:
        logger.info("scikit-learn is not installed: no boosted trees")
    else:
        t = time.perf_counter()
        trees = HistGradientBoostingClassifier(max_iter=300, l2_regularization=1.0, early_stopping=True, random_state=0)
        trees.fit(X[~held], y[~held])
        record("boosted trees", trees.decision_function(X), time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nq", type=int, default=806, help="NQ train contexts of 10 documents (default 806)")
    ap.add_argument("--out", type=Path, default=RESULTS / "probe_capacity.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run(args)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"{'first stage':<28} {'log-loss':>9} {'R-prec':>7} {'rec@4':>7} {'fit s':>7}")
    for name, m in res["models"].items():
        print(
            f"{name:<28} {m['logloss']:>9.4f} {m['r_precision']:>7.4f} {m['recall_at_4']:>7.4f} {m['fit_seconds']:>7}"
        )


if __name__ == "__main__":
    main()
