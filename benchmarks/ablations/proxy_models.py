"""Which proxy model? Probe quality and latency of the embedded SmolLM2-135M vs the 0.5B Qwen2.5 architecture.

Quality: a probe per model trained on the same HotpotQA-train questions and measured on the same dev questions
(from each model's feature cache, see benchmarks/ablations/probe_ablation.py). Latency: median time of the attention
forward pass (`rag_opt.models.extract.extract`) on the same dev prompts, both models measured in this run.

    python benchmarks/ablations/proxy_models.py --cache CACHE --train-limit 150 --dev-limit 100 --latency 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import data_dir

from rag_opt.compressors.features import BASE_BLOCKS, FeatureLayout, build_features
from rag_opt.models.extract import extract
from rag_opt.models.loader import load_proxy_model
from rag_opt.training.datasets import read_hotpotqa
from rag_opt.training.sentence_probe import build_training_set, choose_l2, feature_cache_for, fit_probe, hotpot_units

MODELS = ("embedded:smollm2-135m", "embedded:qwen2.5-coder-0.5b")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    ap.add_argument("--train-limit", type=int, default=150)
    ap.add_argument("--dev-limit", type=int, default=100)
    ap.add_argument("--latency", type=int, default=10, help="dev questions to time per model")
    ap.add_argument("--ratio", type=float, default=1 / 3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "proxy_models.json"))
    args = ap.parse_args()
    from probe_ablation import evaluate  # sibling script (benchmarks/ is on sys.path when run as a script)

    dd = data_dir() / "hotpotqa"
    dev_all = read_hotpotqa(dd / "dev.jsonl.gz", seed=0, limit=args.dev_limit)
    train_all = read_hotpotqa(dd / "train.jsonl.gz", seed=0)
    caches = {m: (feature_cache_for(args.cache, m, "train"), feature_cache_for(args.cache, m, "dev")) for m in MODELS}
    # the same questions for both models: those cached for every model
    train_ids = set.intersection(*(c[0].ids() for c in caches.values()))
    dev_ids = set.intersection(*(c[1].ids() for c in caches.values()))
    train = [ex for ex in train_all if ex.id in train_ids][: args.train_limit]
    dev = [ex for ex in dev_all if ex.id in dev_ids]
    results: dict[str, dict[str, float]] = {}
    for m in MODELS:
        tc, dc = caches[m]
        tf, df = tc.load(ex.id for ex in train), dc.load(ex.id for ex in dev)
        a = next(iter(tf.values()))
        layout = FeatureLayout(BASE_BLOCKS, a.num_layers, a.num_heads)
        X, y, groups = build_training_set(train, tf, layout, progress=False)
        probe = fit_probe(X, y, layout, m, l2=choose_l2(X, y, groups)[0], seed=0, meta={})

        def score(ex, attn, units, probe=probe, layout=layout):  # type: ignore[no-untyped-def]
            return probe.predict_proba(build_features(layout, attn, ex.question, units))

        r = evaluate(dev, df, score, args.ratio)
        proxy = load_proxy_model(m)
        times = []
        for ex in dev[: args.latency]:
            t = time.perf_counter()
            extract(proxy, hotpot_units(ex), ex.question)
            times.append(time.perf_counter() - t)
        r["median_forward_s"] = statistics.median(times)
        r["layers_x_heads"] = float(a.num_layers * a.num_heads)
        results[m] = r
    base = results[MODELS[0]]["median_forward_s"]
    print(f"train questions {len(train)}, dev questions {len(dev)}, ratio {args.ratio:.3f} (same questions for both)")
    print(f"{'model':<32} {'sf_recall':>9} {'all_kept':>9} {'answer':>7} {'forward s':>10} {'× SmolLM':>9}")
    for m, r in results.items():
        print(
            f"{m:<32} {r['sf_recall']:>9.3f} {r['all_facts_kept']:>9.3f} {r['answer_retention']:>7.3f} "
            f"{r['median_forward_s']:>10.2f} {r['median_forward_s'] / base:>9.2f}"
        )
    Path(args.out).write_text(json.dumps({"train": len(train), "dev": len(dev), "results": results}, indent=2))


if __name__ == "__main__":
    main()
