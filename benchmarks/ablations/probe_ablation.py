"""Which probe features help? Train variants on cached HotpotQA-train features, measure on cached dev features.

Runs on the feature cache only (no forward pass): first fill it, e.g.

    rag-opt train-probe --out /tmp/probe.json --limit 1000      # caches train features
    python -c "from rag_opt.training.sentence_probe import extract_hotpot as e; \
        e('../shared/data/hotpotqa/dev.jsonl.gz', C, limit=300)"

then  python benchmarks/ablations/probe_ablation.py --cache CACHE [--train-limit N] [--ratio 0.333]

Measured in the units the features were extracted on (title line + HotpotQA's own sentences), with the same
selection rule as the library (budget in o200k tokens, titles counted when their document is kept).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import data_dir

from rag_opt.compressors.features import ALL_BLOCKS, BASE_BLOCKS, CROSS_BLOCKS, FeatureLayout, build_features
from rag_opt.compressors.lexical import bm25_scores
from rag_opt.compressors.selection import select
from rag_opt.text.tokens import get_token_counter
from rag_opt.text.units import UnitTable
from rag_opt.training.datasets import contains_answer, read_hotpotqa
from rag_opt.training.sentence_probe import build_training_set, choose_l2, feature_cache_for, fit_probe, hotpot_units
from rag_opt.types import Document

logger = logging.getLogger("probe_ablation")


def evaluate(examples, feats, scorer, ratio: float) -> dict[str, float]:
    """Selection at ``ratio`` over the dataset's own sentences (the units the cached features were read for)."""
    counter = get_token_counter("o200k_base")
    rec, allk, ans, ratios = [], [], [], []
    for ex in examples:
        attn = feats.get(ex.id)
        if attn is None:
            continue
        docs = [Document(text=ex.paragraph_text(p), title=t) for p, t in enumerate(ex.titles)]
        bounds = [np.cumsum([0] + [len(x) for x in sents]) for sents in ex.sentences]
        spans = [[(int(b[i]), int(b[i + 1])) for i in range(len(b) - 1)] for b in bounds]
        units = UnitTable.from_spans(docs, spans, counter.count)
        scores = scorer(ex, attn, UnitTable.titled(hotpot_units(ex)))
        sel = select(units, scores, counter.count, limit=int(ratio * units.tokens_before))
        ratios.append(int(sel.tokens_after.sum()) / units.tokens_before)
        kept_set = {
            (int(units.doc[r]), int(r - units.bounds[units.doc[r]] - 1))
            for r in np.flatnonzero(sel.keep & units.candidate)
        }
        sup = ex.supporting
        if sup:
            hits = [s in kept_set for s in sup]
            rec.append(np.mean(hits))
            allk.append(all(hits))
        if not ex.yes_no:
            text = " ".join(ex.sentences[p][s] for p, s in sorted(kept_set))
            ans.append(contains_answer(text, ex.answer))
    return {
        "questions": len(ratios),
        "sf_recall": float(np.mean(rec)),
        "all_facts_kept": float(np.mean(allk)),
        "answer_retention": float(np.mean(ans)),
        "achieved_ratio": float(np.mean(ratios)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument("--train-limit", type=int, default=None)
    ap.add_argument("--dev-limit", type=int, default=300)
    ap.add_argument("--ratio", type=float, default=1 / 3)
    ap.add_argument("--l2", type=float, default=None, help="default: chosen on held-out train questions")
    ap.add_argument("--only-full", action="store_true", help="only the default layout (e.g. for an l2 sweep)")
    ap.add_argument("--out", default=None, help="write results JSON here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    dd = data_dir() / "hotpotqa"
    train_cache = feature_cache_for(args.cache, args.model, "train")
    dev_cache = feature_cache_for(args.cache, args.model, "dev")
    train_ids = train_cache.ids()
    train = [ex for ex in read_hotpotqa(dd / "train.jsonl.gz", seed=0) if ex.id in train_ids][: args.train_limit]
    dev = read_hotpotqa(dd / "dev.jsonl.gz", seed=0, limit=args.dev_limit)
    tf = train_cache.load(ex.id for ex in train)
    df = dev_cache.load(ex.id for ex in dev)
    logger.info("train questions with features: %d; dev: %d", len(tf), len(df))
    any_feat = next(iter(tf.values()))
    L, H = any_feat.num_layers, any_feat.num_heads
    results = {}

    def bm25(ex, attn, units):
        flat = list(units.texts)
        heads = [d[0].strip() + ". " for d in units.by_document() for _ in d]
        return bm25_scores(ex.question, [h + u for h, u in zip(heads, flat, strict=True)])

    def raw(ex, attn, units):
        return attn.unit[:, 1].mean(axis=(1, 2))

    results["bm25"] = evaluate(dev, df, bm25, args.ratio)
    results["raw-attention"] = evaluate(dev, df, raw, args.ratio)
    variants = [
        ("attn_last",),
        ("attn_last", "attn_question"),
        ("attn_last", "attn_question", "doc_attn_question"),
        ("lexical",),
        ("attn_last", "attn_question", "lexical"),
        ("attn_last", "attn_question", "doc_attn_question", "lexical"),
        ("attn_last_ctx", "attn_question_ctx", "doc_attn_question", "lexical"),
        tuple(b for b in ALL_BLOCKS if b not in CROSS_BLOCKS),  # its cache has no cross-document rows
    ]
    if args.only_full:
        variants = [BASE_BLOCKS]
    for blocks in variants:
        layout = FeatureLayout(tuple(blocks), L, H)
        t = time.time()
        X, y, groups = build_training_set(train, tf, layout, progress=False)
        l2 = args.l2 if args.l2 is not None else choose_l2(X, y, groups)[0]
        probe = fit_probe(X, y, layout, args.model, l2=l2, seed=0, meta={})
        fit_s = time.time() - t

        def score(ex, attn, units, probe=probe, layout=layout):
            return probe.predict_proba(build_features(layout, attn, ex.question, units))

        r = evaluate(dev, df, score, args.ratio)
        r["fit_s"] = fit_s
        r["l2"] = l2
        results["probe:" + "+".join(blocks)] = r
        logger.info("%s: %s", "+".join(blocks), r)
    print(f"train questions: {len(tf)}, dev questions: {len(df)}, ratio {args.ratio:.3f}")
    print(f"{'method':<60} {'sf_recall':>9} {'all_kept':>9} {'answer':>7} {'ratio':>6}")
    for name, r in results.items():
        print(
            f"{name:<60} {r['sf_recall']:>9.3f} {r['all_facts_kept']:>9.3f} "
            f"{r['answer_retention']:>7.3f} {r['achieved_ratio']:>6.3f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"train": len(tf), "dev": len(df), "results": results}, indent=2))


if __name__ == "__main__":
    main()
