"""Which second-stage (context) features help multi-hop evidence? Ablated one by one, then forward-selected.

Runs on cached attention features only (no forward pass). The first stage (the shipped layout, first
``--layers`` layers) is trained on HotpotQA train questions; the second stage on its 5-fold held-out logits
(:func:`rag_opt.training.sentence_probe.fit_context_stage`). Each variant is measured on HotpotQA dev questions
``--select`` (default 200:400 of the seeded shuffle — *not* the 200 the headline benchmark
``benchmarks/compression.py`` reports), with the library's selection at a budget of 1/3 in o200k tokens (titles
counted), in HotpotQA's own sentences (see ``benchmarks/ablations/probe_ablation.py``).

Fill the caches first (bf16, 16 layers), e.g. ``rag-opt train-probe --dtype bfloat16 --layers 16 ...`` for train and
``python -c "from rag_opt.training.sentence_probe import extract_hotpot as e; e('../shared/data/hotpotqa/dev.jsonl.gz',
C, dtype='bfloat16', layers=16, limit=400)"`` for dev; then

    python benchmarks/ablations/context_ablation.py [--train-limit N]   # → benchmarks/results/context_ablation.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import data_dir
from probe_ablation import evaluate

from rag_opt.compressors.context_features import CONTEXT_FEATURES
from rag_opt.compressors.features import BASE_BLOCKS, FeatureLayout, build_features
from rag_opt.paths import cache_dir
from rag_opt.training.datasets import read_hotpotqa
from rag_opt.training.feature_cache import FeatureStore
from rag_opt.training.logistic import cross_val_scores
from rag_opt.training.sentence_probe import (
    build_training_set,
    choose_l2,
    feature_folder,
    fit_context_stage,
    fit_probe,
)

RESULTS = Path(__file__).resolve().parents[1] / "results"
logger = logging.getLogger("context_ablation")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument("--precision", default="bfloat16")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--model-layers", type=int, default=30)
    ap.add_argument("--train-limit", type=int, default=None)
    ap.add_argument("--select", default="200:400", help="dev questions (slice of the seeded shuffle)")
    ap.add_argument("--ratio", type=float, default=1 / 3)
    ap.add_argument(
        "--min-gain",
        type=float,
        default=0.01,
        help="forward selection adds a feature only when recall + answer kept rise by this much (default 0.01)",
    )
    ap.add_argument("--out", default=str(RESULTS / "context_ablation.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    folder = feature_folder(cache_dir() / "features", args.model)

    def store(name: str) -> FeatureStore:
        return FeatureStore(folder, name, args.precision, args.layers, args.model_layers)

    dd = data_dir() / "hotpotqa"
    train_store, dev_store = store("train"), store("dev")
    tf = train_store.load()
    train = [ex for ex in read_hotpotqa(dd / "train.jsonl.gz", seed=0) if ex.id in tf][: args.train_limit]
    a, b = (int(x) for x in args.select.split(":"))
    dev = read_hotpotqa(dd / "dev.jsonl.gz", seed=0, limit=b)[a:]
    df = dev_store.load(ex.id for ex in dev)
    dev = [ex for ex in dev if ex.id in df]
    if not train or not dev:
        raise SystemExit("no cached features: fill the train and dev caches first (see the docstring)")
    layout = FeatureLayout(BASE_BLOCKS, args.layers, args.heads)
    tables: list = []
    X, y, groups = build_training_set(train, tf, layout, progress=False, tables=tables)
    l2, _ = choose_l2(X, y, groups)
    first = fit_probe(X, y, layout, args.model, l2=l2, seed=0, meta={})
    held_out = cross_val_scores(X, y, groups, l2=l2)

    results: dict[str, dict[str, object]] = {}

    def run(names: tuple[str, ...]) -> float:
        """Measure the first stage alone (no names) or with a second stage over ``names``."""
        stage = fit_context_stage(tables, held_out, y, names) if names else None

        def score(ex, attn, units):
            z = first.decision(build_features(layout, attn, ex.question, units))
            return stage.decision(z, units) if stage is not None else z

        r = evaluate(dev, df, score, args.ratio)
        if stage is not None:
            r["weights"] = dict(zip(names, np.round(stage.weights, 3).tolist(), strict=True))
        results["first stage only" if not names else "+".join(names)] = r
        logger.info("%s: %s", names, r)
        return float(r["sf_recall"]) + float(r["answer_retention"])

    run(())
    base = ("own",)
    chosen, best = base, run(base)
    for name in CONTEXT_FEATURES[1:]:  # one by one on top of the unit's own logit
        run((*base, name))
    while True:  # forward selection: add the feature that moves recall + answer kept most, while it helps
        trials = {n: run((*chosen, n)) for n in CONTEXT_FEATURES if n not in chosen}
        if not trials:
            break
        name = max(trials, key=lambda k: trials[k])
        if trials[name] < best + args.min_gain:
            break
        chosen, best = (*chosen, name), trials[name]
    print(f"train questions: {len(train)}, dev questions {args.select}: {len(dev)}, ratio {args.ratio:.3f}")
    print(f"{'second stage':<70} {'sf_recall':>9} {'all_kept':>9} {'answer':>7} {'ratio':>6}")
    for name, r in results.items():
        print(
            f"{name:<70} {r['sf_recall']:>9.3f} {r['all_facts_kept']:>9.3f} "
            f"{r['answer_retention']:>7.3f} {r['achieved_ratio']:>6.3f}"
        )
    print(f"forward selection keeps: {', '.join(chosen)}")
    Path(args.out).write_text(
        json.dumps(
            {"train": len(train), "dev": len(dev), "select": args.select, "chosen": chosen, "results": results},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
