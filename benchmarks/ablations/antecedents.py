"""Keeping a back-reference only with its antecedent: what it does to compression quality.

    OMP_NUM_THREADS=1 python benchmarks/ablations/antecedents.py --hotpot 300          # → results/antecedents.json
    OMP_NUM_THREADS=1 python benchmarks/ablations/antecedents.py --compare references --hotpot 300 --squad 300
                                                                          # → results/antecedents_references.json

``--compare pronouns`` (the first run): an English sentence that opens with a back-reference (``It``, ``She``,
``These``, ...) is, by default, kept only together with the sentence before it (``SelectionOptions.
keep_antecedents``), so no kept sentence dangles; the arms are without the rule and with it.

``--compare references``: the arms are today's rule and today's rule extended to demonstrative and definite
references ("than that", "this method", "The treatment works ...": ``SelectionOptions.keep_references``,
:mod:`rag_opt.text.references`).

On the first ``--hotpot`` HotpotQA dev questions of the seeded shuffle (titles as a field; ``--titles none``: no
title given) and, with ``--squad``, the first SQuAD 2.0 dev answerable questions of ``compression.py``'s sample
(the question's paragraph among up to 4
others of its article), both selection rules run on the same scores (the model tier's scores are computed once per
context and reused; the lexical tier's too), at 1/3 and 1/5, and the paired differences (second arm minus first)
come with 95 % bootstrap intervals. Besides the quality metrics, each arm reports the kept tokens (``tokens``, and
the achieved ``ratio``) and ``dangling``: the share of kept sentences that lean on a sentence before them (by an
opening pronoun or a reference of :mod:`rag_opt.text.references`) that was not kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir, paired_bootstrap  # noqa: E402
from compression import MemoScorer, hotpot_metrics, squad_examples, squad_metrics  # noqa: E402

from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.text.references import leans_on_previous  # noqa: E402
from rag_opt.training.datasets import read_hotpotqa  # noqa: E402
from rag_opt.types import OptimizeResult  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
METRICS = {
    "hotpot": ("sf_recall", "all_facts_kept", "answer_retention", "tokens", "ratio", "dangling"),
    "squad": ("answer_sentence_kept", "answer_retention", "tokens", "ratio", "dangling"),
}
RATIOS = (1 / 3, 1 / 5)
ARMS = {"pronouns": ("without", "with"), "references": ("today", "extended")}


def dangling(result: OptimizeResult, sources: dict[str, str]) -> float | None:
    """The share of kept sentences that lean on the sentence just before them (an opening pronoun, or a reference
    of :mod:`rag_opt.text.references`) when that one was not kept; None when no sentence is kept."""
    kept = leaning = 0
    for doc in result.documents:
        text = sources[doc.id]
        sentences = [u for u in doc.units if u.kind == "sentence"]
        lead = ""
        for i, u in enumerate(sentences):
            s = text[u.start : u.end]
            if u.kept:
                kept += 1
                if i and not sentences[i - 1].kept and sentences[i - 1].end == u.start:
                    before = text[sentences[i - 1].start : sentences[i - 1].end]
                    if leans_on_previous(s, before, title=doc.title, lead=lead):
                        leaning += 1
            if len(lead.split()) < 5:
                lead += s
    return leaning / kept if kept else None


def _row(metrics: dict[str, float | None], result: OptimizeResult, sources: dict[str, str]) -> dict[str, Any]:
    return {**metrics, "tokens": float(result.tokens_after), "dangling": dangling(result, sources)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rag_opt.compressors import SentinelCompressor
    from rag_opt.compressors.lexical_scorer import LexicalScorer
    from rag_opt.models.loader import load_proxy_model

    first, second = ARMS[args.compare]
    hotpot = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.hotpot)
    squad = squad_examples(args.squad) if args.squad else []
    scorers: dict[str, Any] = {"lexical": MemoScorer(LexicalScorer())}
    if not args.lexical_only:
        proxy = load_proxy_model(None, dtype="bfloat16")
        scorers = {"model": MemoScorer(SentinelCompressor(proxy, encoding="parallel")), **scorers}
    tiers: dict[str, dict[str, ContextOptimizer]] = {}
    # (keep_antecedents, keep_references) of each arm
    arms = {"pronouns": ((False, False), (True, False)), "references": ((True, False), (True, True))}[args.compare]
    for tier, scorer in scorers.items():
        tiers[tier] = {}
        for arm, (antecedents, references) in zip((first, second), arms, strict=True):
            opt = ContextOptimizer(scorer=scorer, keep_antecedents=antecedents)
            opt.selection_options = replace(opt.selection_options, keep_references=references)
            tiers[tier][arm] = opt
    rows: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    from tqdm.auto import tqdm

    for ex in tqdm(hotpot, desc="hotpot", mininterval=30):
        docs = [
            {"id": t, "text": ex.paragraph_text(p)} | ({"title": t} if args.titles == "field" else {})
            for p, t in enumerate(ex.titles)
        ]
        sources = {d["id"]: d["text"] for d in docs}
        for tier, opts in tiers.items():
            for r in RATIOS:
                for arm, opt in opts.items():
                    res = opt.optimize(ex.question, docs, ratio=r)
                    rows.setdefault(("hotpot", tier, f"{r:.3f}", arm), []).append(
                        _row(hotpot_metrics(ex, res), res, sources)
                    )
        for scorer in scorers.values():
            scorer.cache.clear()
    for sx in tqdm(squad, desc="squad", mininterval=30):
        sources = {d["id"]: d["text"] for d in sx["docs"]}
        for tier, opts in tiers.items():
            for r in RATIOS:
                for arm, opt in opts.items():
                    res = opt.optimize(sx["question"], sx["docs"], ratio=r)
                    rows.setdefault(("squad", tier, f"{r:.3f}", arm), []).append(
                        _row(squad_metrics(sx, res), res, sources)
                    )
        for scorer in scorers.values():
            scorer.cache.clear()
    out: dict[str, Any] = {
        "compare": args.compare,
        "arms": [first, second],
        "hotpot_questions": len(hotpot),
        "titles": args.titles,
        "squad_questions": len(squad),
        "results": {},
    }
    for (data, tier, ratio, arm), a in rows.items():
        if arm != first:
            continue
        b = rows[(data, tier, ratio, second)]
        out["results"][f"{data} {tier} {ratio}"] = {
            m: {
                first: _mean([x[m] for x in a]),
                second: _mean([x[m] for x in b]),
                **paired_bootstrap([x[m] for x in a], [x[m] for x in b]),
            }
            for m in METRICS[data]
        } | {"changed": float(np.mean([x != y for x, y in zip(a, b, strict=True)]))}
    return out


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=sorted(ARMS), default="pronouns")
    ap.add_argument("--hotpot", type=int, default=300)
    ap.add_argument("--squad", type=int, default=0, help="SQuAD 2.0 dev answerable questions (0: none)")
    ap.add_argument("--lexical-only", action="store_true", help="the lexical tier only (no model)")
    ap.add_argument(
        "--titles", choices=["field", "none"], default="field", help="HotpotQA titles as a field, or not given"
    )
    ap.add_argument("--out", default=None, help="default: results/antecedents.json, or antecedents_references.json")
    args = ap.parse_args()
    out = args.out or str(
        RESULTS / ("antecedents.json" if args.compare == "pronouns" else "antecedents_references.json")
    )
    res = run(args)
    Path(out).write_text(json.dumps(res, indent=1) + "\n")
    first, second = res["arms"]
    for key, by_metric in res["results"].items():
        cells = [
            f"{m} {v[first]:.3f} -> {v[second]:.3f} ({v['diff']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}])"
            for m, v in by_metric.items()
            if isinstance(v, dict) and v["diff"] is not None and m != "tokens"
        ]
        tokens = by_metric["tokens"]
        print(
            key,
            f"changed {by_metric['changed']:.2f} | tokens {tokens[first]:.1f} -> {tokens[second]:.1f} |",
            " | ".join(cells),
        )


if __name__ == "__main__":
    main()
