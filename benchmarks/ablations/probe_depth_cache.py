"""Issue 51: do sentence probes trained on the first L layers only keep the quality of a 16-layer one?

Paired evaluation on HotpotQA dev (the seeded shuffle of ``benchmarks/compression.py``, titles as a field, parallel
encoding) of several sentence probes, each through the same pipeline as ``compression.py`` (``ContextOptimizer(
scorer=...)``, the same metrics: supporting-fact recall, all facts kept, answer kept). The proxy's forward pass runs
once per question, to the deepest layer any arm reads (16 with the shipped document probe); each arm reads its own
first L layers of it (``features._fit``), which is exactly what an early exit after L layers computes.

Then each arm is compared with ``--baseline`` (paired bootstrap, ``common.paired_bootstrap``), and ``--cache-check``
measures the bytes an ``EncodingCache`` (default ``k8v2`` format) stores per document token with each probe, with
the shipped document probe and without one (``doc_probe=None``).

    OMP_NUM_THREADS=1 python benchmarks/ablations/probe_depth_cache.py --hotpot 200 --ratios 1/3,1/5 \\
        --arm L16=/tmp/depth/probes/L16.json --arm L12=/tmp/depth/probes/L12.json --arm shipped=auto \\
        --baseline L16 --out benchmarks/results/probe_depth/eval.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, compression.py

logger = logging.getLogger("bench.probe_depth")
METRICS = ("sf_recall", "all_facts_kept", "answer_retention")


def say(*parts: object) -> None:
    logger.info(" ".join(str(p) for p in parts))


class SharedAttention:
    """One forward pass per context, to ``depth`` layers, shared by every arm."""

    def __init__(self, proxy: Any, depth: int, max_tokens: int = 8192) -> None:
        self.proxy, self.depth, self.max_tokens = proxy, depth, max_tokens
        self.key: Any = None
        self.attn: Any = None
        self.ms: list[float] = []

    def get(self, question: str, units: Any) -> Any:
        from rag_opt.models.extract import extract

        key = (question, units.texts)
        if key != self.key:
            t = time.perf_counter()
            self.attn = extract(
                self.proxy,
                units.by_document(),
                question,
                max_tokens=self.max_tokens,
                layers=self.depth,
                cross=True,
                encoding="parallel",
            )
            self.ms.append((time.perf_counter() - t) * 1e3)
            self.key = key
        return self.attn


class ArmScorer:
    """An arm's sentinel scoring the shared features (its probe reads its own first layers of them)."""

    def __init__(self, sentinel: Any, shared: SharedAttention) -> None:
        self.sentinel, self.shared = sentinel, shared

    def score(self, question: str, units: Any) -> Any:
        return self.sentinel._scores(self.shared.get(question, units), question, units, True)


def cache_check(arms: dict[str, str], examples: list[Any], dtype: str) -> dict[str, Any]:
    """Bytes per document token an EncodingCache stores with each probe (default format), with the shipped document
    probe and with none."""
    from compression import hotpot_documents

    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.pipeline import ContextOptimizer

    proxy = load_proxy_model(None, dtype=dtype)
    tok = proxy.tokenizer
    out: dict[str, Any] = {}
    for name, path in arms.items():
        for doc_probe in ("auto", None):
            cache = EncodingCache()
            opt = ContextOptimizer(probe=path, doc_probe=doc_probe, encoding="parallel", cache=cache, dtype=dtype)
            tokens = 0
            for ex in examples:
                docs, _ = hotpot_documents(ex, "field")
                opt.optimize(ex.question, docs, ratio=1 / 3)
                tokens += sum(len(tok(d["title"] + "\n" + d["text"])["input_ids"]) for d in docs)
            st = cache.stats()
            key = f"{name} doc_probe={'shipped(16 layers)' if doc_probe else 'none'}"
            out[key] = {
                "format": st.format,
                "entries": st.entries,
                "bytes": st.bytes,
                "approx_doc_tokens": tokens,
                "bytes_per_token_approx": st.bytes / max(tokens, 1),
            }
            say(
                f"cache {key}: {st.entries} entries, {st.bytes} B, ~{st.bytes / max(tokens, 1):.0f} B/token", flush=True
            )
    return out


def main() -> None:
    from common import data_dir, paired_bootstrap
    from compression import MemoScorer, hotpot_documents, hotpot_metrics, summarize

    from rag_opt.compressors.sentinel import SentinelCompressor
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.training.datasets import read_hotpotqa

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hotpot", type=int, default=200)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--ratios", default="1/3,1/5")
    ap.add_argument("--arm", action="append", required=True, help="NAME=PROBE (a path, or 'auto': the shipped one)")
    ap.add_argument("--doc-probe", default="auto", help="document probe of every arm ('auto', a path, 'none')")
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-check", type=int, default=0, help="dev questions for the cache-size check (0: skip)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    arms = dict(a.split("=", 1) for a in args.arm)
    ratios = [float(Fraction(r)) for r in args.ratios.split(",")]
    hotpot = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + args.hotpot)
    hotpot = hotpot[args.offset :]
    proxy = load_proxy_model(None, dtype=args.dtype)
    doc_probe = None if args.doc_probe == "none" else args.doc_probe
    sentinels = {n: SentinelCompressor(proxy, p, doc_probe=doc_probe, encoding="parallel") for n, p in arms.items()}
    depth = max(s.layers(True) for s in sentinels.values())
    say("arms:", {n: (s.probe.layout.num_layers, s.layers(True)) for n, s in sentinels.items()}, "shared depth", depth)
    shared = SharedAttention(proxy, depth)
    memos = {n: MemoScorer(ArmScorer(s, shared)) for n, s in sentinels.items()}
    opts = {n: ContextOptimizer(scorer=m) for n, m in memos.items()}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {n: {f"{r:.3f}": [] for r in ratios} for n in arms}
    t0 = time.time()
    for i, ex in enumerate(hotpot):
        docs, shifts = hotpot_documents(ex, "field")
        for n, opt in opts.items():
            for r in ratios:
                res = opt.optimize(ex.question, docs, ratio=r)
                rows[n][f"{r:.3f}"].append(hotpot_metrics(ex, res, shifts))
        for m in memos.values():
            m.cache.clear()
        if (i + 1) % 20 == 0:
            say(f"{i + 1}/{len(hotpot)} questions, {time.time() - t0:.0f} s")
    summary = {n: {r: summarize(v) for r, v in per.items()} for n, per in rows.items()}
    paired: dict[str, Any] = {}
    for n in arms:
        if n == args.baseline:
            continue
        for r in rows[n]:
            for m in METRICS:
                paired.setdefault(f"{n} - {args.baseline}", {}).setdefault(r, {})[m] = paired_bootstrap(
                    [x[m] for x in rows[args.baseline][r]], [x[m] for x in rows[n][r]]
                )
    results: dict[str, Any] = {
        "hotpot_dev_questions": len(hotpot),
        "offset": args.offset,
        "titles": "field",
        "encoding": "parallel",
        "dtype": args.dtype,
        "doc_probe": args.doc_probe,
        "ratios": ratios,
        "arms": {
            n: {
                "probe": p,
                "layers": sentinels[n].probe.layout.num_layers,
                "meta": sentinels[n].probe.metadata if hasattr(sentinels[n].probe, "metadata") else None,
            }
            for n, p in arms.items()
        },
        "shared_forward_depth": depth,
        "median_forward_ms": sorted(shared.ms)[len(shared.ms) // 2] if shared.ms else None,
        "summary": summary,
        "paired_vs_baseline": paired,
        "per_question": rows,
        "command": " ".join(sys.argv),
    }
    if args.cache_check:
        results["cache_check"] = cache_check(arms, hotpot[: args.cache_check], args.dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    for n in arms:
        for r in summary[n]:
            s = summary[n][r]
            say(f"{n:10s} r={r}: " + "  ".join(f"{m} {s.get(m, float('nan')):.4f}" for m in METRICS))
    for k, per in paired.items():
        for r, ms in per.items():
            say(
                f"{k} r={r}: "
                + "  ".join(f"{m} {v['diff']:+.4f} [{v['low']:+.4f}, {v['high']:+.4f}]" for m, v in ms.items())
            )


if __name__ == "__main__":
    main()
