"""Which share of untitled training contexts makes a tier hold its quality without titles?

    python benchmarks/ablations/title_mix.py                    # lexical tier → results/title_mix_lexical.json
    python benchmarks/ablations/title_mix.py --tier model --shares 0,0.5 --train-limit 600 --select 200:320
                                                                # model tier → results/title_mix_model.json

For each share ``s`` of ``--shares``, the tier's sentence probe is trained on HotpotQA train with
``title_mix = {field: 1 - s, none: s}`` (the ``text`` regime reads the same tokens as ``field`` and needs no share of
its own): the lexical probe by :func:`rag_opt.training.lexical_probe.train_lexical_probe`, the model tier's by
:func:`rag_opt.training.sentence_probe.train_probe_cli` (parallel encoding, the shipped blocks and second stage, at
this machine's precision; features cached under ``--cache``, HotpotQA only). The model tier also measures the shipped
probe as a reference row (trained on 4,445 HotpotQA + 806 NQ contexts in bf16). Each candidate is measured on HotpotQA
dev questions ``--select`` (default 200:400 of the seeded shuffle — *not* the 200 that ``benchmarks/compression.py``
reports), given with a title field and without any title, at 1/3 and 1/5 of the o200k tokens, by the library's own
``ContextOptimizer`` and the compression benchmark's metrics.

The share chosen is the one with the highest *score*: the mean of supporting-fact recall and answer kept over both
title regimes and both budgets. The report also shows each candidate's gap (title field minus no title).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir, run_or_report  # noqa: E402
from compression import hotpot_documents, hotpot_metrics  # noqa: E402

from rag_opt.compressors.lexical_scorer import LexicalScorer  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.training.datasets import read_hotpotqa  # noqa: E402
from rag_opt.training.lexical_probe import train_lexical_probe  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
REGIMES = ("field", "none")
METRICS = ("sf_recall", "answer_retention")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    a, b = (int(x) for x in args.select.split(":"))
    dev = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=b)[a:]
    ratios = [float(Fraction(r)) for r in args.ratios.split(",")]
    train = data_dir() / "hotpotqa" / "train.jsonl.gz"
    out: dict[str, Any] = {
        "tier": args.tier,
        "select": args.select,
        "questions": len(dev),
        "ratios": ratios,
        "train_limit": args.train_limit,
        "candidates": {},
    }
    arms: list[tuple[str, dict[str, float] | None]] = []
    if args.tier == "model":
        arms.append(("shipped", None))
    for share in (float(s) for s in args.shares.split(",")):
        arms.append((f"{share:g}", {"field": 1.0 - share, "none": share} if share else {"field": 1.0}))
    sentinel = None
    for name, mix in arms:
        if args.tier == "lexical":
            assert mix is not None
            with tempfile.TemporaryDirectory() as tmp:
                probe = train_lexical_probe(train, Path(tmp) / "lexical.json", limit=args.train_limit, title_mix=mix)
            opt = ContextOptimizer(scorer=LexicalScorer(probe))
        else:
            sentinel = model_scorer(args, train, mix, sentinel)
            probe = sentinel.probe
            opt = ContextOptimizer(scorer=sentinel)
        cells: dict[str, dict[str, float]] = {}
        for regime in REGIMES:
            for r in ratios:
                rows = []
                for ex in tqdm(dev, desc=f"{name} [{regime}] r={r:.2f}", mininterval=10):
                    docs, shifts = hotpot_documents(ex, regime)
                    rows.append(hotpot_metrics(ex, opt.optimize(ex.question, docs, ratio=r), shifts))
                cells[f"{regime} {r:.3f}"] = {
                    m: float(np.mean([x[m] for x in rows if x[m] is not None])) for m in METRICS
                }
        score = float(np.mean([c[m] for c in cells.values() for m in METRICS]))
        out["candidates"][name] = {
            "title_mix": mix,
            "trained_on": probe.metadata["trained_on"] if probe is not None else None,
            "cells": cells,
            "score": score,
        }
    out["chosen"] = max((k for k in out["candidates"] if k != "shipped"), key=lambda k: out["candidates"][k]["score"])
    return out


def model_scorer(args: argparse.Namespace, train: Path, mix: dict[str, float] | None, previous: Any) -> Any:
    """The model tier's scorer with the shipped probe (``mix`` None) or one trained with ``mix``; the proxy and its
    encoding cache are shared between candidates (a document is encoded once for all of them), and the trained ones
    read the shipped probe's feature blocks and second stage (``previous``: the shipped probe's scorer)."""
    from rag_opt.compressors import SentinelCompressor
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.training.sentence_probe import train_probe_cli

    if mix is None:
        # big enough for every dev document in both regimes: each is encoded once for all candidates and budgets
        return SentinelCompressor.from_model(None, encoding="parallel", cache=EncodingCache(args.cache_gib << 30))
    out = Path(args.cache) / f"probe-{'-'.join(f'{k}{v:g}' for k, v in mix.items())}.json"
    probe = train_probe_cli(
        data=str(train),
        out=str(out),
        model=None,
        limit=args.train_limit,
        seed=0,
        cache_root=args.cache,
        l2=None,
        blocks=tuple(previous.probe.layout.blocks),  # the shipped probe's blocks, depth, precision and second stage
        layers=previous.probe.layout.num_layers,  # (at full depth every document would be encoded again, 2x deeper)
        dtype=str(previous.proxy.dtype).removeprefix("torch."),
        context=previous.probe.context.names if previous.probe.context is not None else None,
        encoding="parallel",
        title_mix=mix,
    )
    return SentinelCompressor(previous.proxy, probe, encoding="parallel", cache=previous.cache)


def show(res: dict[str, Any]) -> None:
    print(
        f"{res.get('tier', 'lexical')} tier's probe by share of untitled training contexts; "
        f"HotpotQA dev {res['select']} ({res['questions']} questions); recall / answer kept"
    )
    ratios = [f"{r:.3f}" for r in res["ratios"]]
    head = "  ".join(f"{g} {r}".ljust(15) for r in ratios for g in REGIMES)
    print(f"{'untitled share':<15}{head}  {'gap (field - none)':<22}score")
    for share, c in res["candidates"].items():
        cells = "  ".join(
            f"{c['cells'][f'{g} {r}']['sf_recall']:.3f} / {c['cells'][f'{g} {r}']['answer_retention']:.3f}".ljust(15)
            for r in ratios
            for g in REGIMES
        )
        gaps = " ".join(
            f"{c['cells'][f'field {r}']['sf_recall'] - c['cells'][f'none {r}']['sf_recall']:+.3f}" for r in ratios
        )
        mark = "  <- chosen" if share == res["chosen"] else ""
        print(f"{share:<15}{cells}  {gaps:<22}{c['score']:.4f}{mark}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shares", default="0,0.2,0.35,0.5,0.65", help="shares of untitled training contexts to try")
    ap.add_argument("--select", default="200:400", help="dev questions (slice of the seeded shuffle)")
    ap.add_argument("--ratios", default="1/3,1/5")
    ap.add_argument("--train-limit", type=int, default=None, help="train on the first N questions (default all)")
    ap.add_argument("--tier", choices=("lexical", "model"), default="lexical")
    ap.add_argument(
        "--cache", default="/tmp/rag-opt-title-mix", help="model tier: the feature cache and the trained probes"
    )
    ap.add_argument("--cache-gib", type=int, default=8, help="model tier: the encoding cache's bound in GiB")
    ap.add_argument("--out", default=None, help="default: results/title_mix_<tier>.json")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not args.report_only and not (data_dir() / "hotpotqa" / "dev.jsonl.gz").is_file():
        raise SystemExit(f"real data not found under {data_dir()}: this ablation needs ../shared/data")
    out = Path(args.out) if args.out else RESULTS / f"title_mix_{args.tier}.json"
    run_or_report(out, args.report_only, lambda: run(args), show)


if __name__ == "__main__":
    main()
