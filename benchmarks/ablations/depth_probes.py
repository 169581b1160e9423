"""Train sentence and document probes on the first K layers only (early exit), from cached features.

Early exit leaves the first K layers' attention unchanged, so one full-depth feature cache serves every depth:
the features of layers >= K are simply not read. Writes ``sentence-L{K}.json`` and ``doc-L{K}.json`` into
``--out`` for ``benchmarks/latency.py --probe-dir`` (which measures their dev quality and speed), and prints the
5-fold cross-validated document Recall@3 of each depth on the training questions.

    python benchmarks/ablations/depth_probes.py --layers 30,24,20,16,12 --hotpot-cache train-bf16 \\
        --nq-cache nq-train-n20-bf16 --precision bfloat16 --out /tmp/depth-probes

The caches are those of ``rag-opt train-probe`` / ``train-doc-probe``
(``<rag-opt cache>/features/<model>/<template>/<name>``); the ``-bf16`` ones are filled by an extraction with
``dtype="bfloat16"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py


def main() -> None:
    from common import data_dir

    from rag_opt.artifacts.position_profiles import ProfileStore
    from rag_opt.compressors.doc_relevance import DEFAULT_DOC_BLOCKS
    from rag_opt.compressors.features import BASE_BLOCKS, FeatureLayout
    from rag_opt.models.prompt import TEMPLATE_ID
    from rag_opt.paths import cache_dir
    from rag_opt.training.datasets import read_hotpotqa
    from rag_opt.training.doc_probe import train_doc_probe
    from rag_opt.training.nq_contexts import nq_records, random_positions
    from rag_opt.training.sentence_probe import build_training_set, choose_l2, feature_cache_for, fit_probe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="30,24,20,16,12")
    ap.add_argument("--hotpot-cache", default="train", help="feature cache name of the HotpotQA train questions")
    ap.add_argument("--hotpot-limit", type=int, default=425)
    ap.add_argument("--nq-cache", default=None, help="feature cache name of the NQ train contexts (20 documents)")
    ap.add_argument("--nq-limit", type=int, default=220)
    ap.add_argument("--precision", default="float32", help="the precision the features were extracted at")
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = cache_dir() / "features"
    depths = [int(k) for k in args.layers.split(",")]
    examples = read_hotpotqa(data_dir() / "hotpotqa" / "train.jsonl.gz", limit=args.hotpot_limit, seed=0)
    feats = feature_cache_for(root, args.model, args.hotpot_cache).load(ex.id for ex in examples)
    if not feats:
        raise SystemExit(f"no cached features in {args.hotpot_cache!r}: extract them first")
    report: dict[str, dict[str, object]] = {}
    for k in depths:
        layout = FeatureLayout(BASE_BLOCKS, k, args.heads)
        X, y, groups = build_training_set(examples, feats, layout, progress=False)
        l2, losses = choose_l2(X, y, groups)
        meta = {
            "trained_on": f"hotpotqa/train.jsonl.gz: {len(set(groups.tolist()))} questions, {len(y)} sentences",
            "positives": int(y.sum()),
            "labels": "supporting facts + sentences containing the answer (yes/no answers mark no sentence)",
            "seed": 0,
            "l2": l2,
            "l2_heldout_logloss": {str(a): b for a, b in losses.items()},
            "template": TEMPLATE_ID,
            "layers": k,
            "precision": args.precision,
        }
        fit_probe(X, y, layout, args.model, l2=l2, seed=0, meta=meta).save(out / f"sentence-L{k}.json")
        report[f"L{k}"] = {"sentence_heldout_logloss": losses[l2]}
        print(f"L{k}: sentence probe l2 {l2}, held-out log-loss {losses[l2]:.4f}", flush=True)
    if args.nq_cache:
        records = nq_records(data_dir() / "nq_multidoc" / "public.jsonl.gz", "train")[: args.nq_limit]
        instances = random_positions(records, 20, seed=0)
        nq = feature_cache_for(root, args.model, args.nq_cache).load(i.id for i in instances)
        profile = ProfileStore().get(args.model, 20)
        if profile is None:
            raise SystemExit("no calibration profile for 20 documents")
        for k in depths:
            probe, rep = train_doc_probe(
                [i for i in instances if i.id in nq],
                nq,
                {20: profile},
                model_name=args.model,
                num_layers=k,
                num_heads=args.heads,
                blocks=DEFAULT_DOC_BLOCKS,
                meta={"layers": k, "precision": args.precision, "trained_on": f"nq_multidoc train: {len(nq)} × N=20"},
            )
            probe.save(out / f"doc-L{k}.json")
            cv = rep["cv_5fold"]
            report[f"L{k}"]["doc_cv_recall@3"] = cv["recall@3"]
            print(f"L{k}: document probe 5-fold Recall@1 {cv['recall@1']:.3f}, Recall@3 {cv['recall@3']:.3f}")
    (out / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
