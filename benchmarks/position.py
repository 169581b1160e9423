"""Position bias of document relevance on the Lost-in-the-Middle NQ setting (and key-value retrieval).

For N documents with the gold passage at each position of the lost-in-the-middle grid, rank the documents by
  - raw attention: share of the final token's attention on each document, mean over layers and heads;
  - FITM-calibrated attention: the same minus the per-slot share measured with non-relevant documents;
  - rag-opt: the document relevance `optimize()` reports (the sentence probe's best sentence per document);
  - BM25 over "title. text";
  - retriever order (the input order);
and report gold Recall@1 / Recall@3 per gold position, the spread across positions (min/max) and the raw
attention each slot receives (the U-curve). Questions come from the NQ `test` split (never trained on); the
positional profiles from the `calibration` split (`rag-opt calibrate`), built here when missing.

    python benchmarks/position.py --n-docs 10,20,30 --questions 20      # → benchmarks/results/position.{json,png}
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from rag_opt.attention import VIEWS, extract
from rag_opt.calibration import PositionProfile, ProfileStore, estimate_profile, nq_calibration_contexts
from rag_opt.compressors import SentinelCompressor
from rag_opt.datasets import NQExample, data_dir, nq_split, read_jsonl, read_nq_multidoc
from rag_opt.features import ContextUnits
from rag_opt.lexical import bm25_scores
from rag_opt.proxy import ProxyModel
from rag_opt.text import segment

logger = logging.getLogger("bench.position")
RESULTS = Path(__file__).resolve().parent / "results"
GRID = {10: [0, 4, 9], 20: [0, 4, 9, 14, 19], 30: [0, 4, 9, 14, 19, 24, 29]}
LAST = VIEWS.index("last")


def rank_of_gold(scores: np.ndarray, gold: int) -> int:
    """1-based rank of the gold document (ties count against it)."""
    return int((scores > scores[gold]).sum() + (scores == scores[gold]).sum())


def profile_for(proxy: ProxyModel, n_docs: int, contexts: int) -> PositionProfile:
    store = ProfileStore()
    prof = store.get(proxy.name, n_docs)
    if prof is None:
        prof = estimate_profile(proxy, nq_calibration_contexts(n_docs, contexts), n_docs)
        store.put(prof)
    return prof


def units_for(docs: list[dict[str, str]]) -> ContextUnits:
    texts = []
    for d in docs:
        segs = segment(d["text"])
        texts.append([f"{d['title']}\n", *(d["text"][s.start : s.end] for s in segs)])
    return ContextUnits(docs=texts, candidate=[[False] + [True] * (len(t) - 1) for t in texts])


def run_nq(sentinel: SentinelCompressor, ex: NQExample, n_docs: int, gold_at: int, prof: PositionProfile) -> dict:
    docs = ex.documents(n_docs, gold_at)
    units = units_for(docs)
    sc = sentinel.score(ex.question, units)
    assert sc.attention is not None
    mass = sc.attention.doc_mass  # (n_docs, views, L, H)
    raw = mass[:, LAST].mean(axis=(1, 2))
    cal = prof.calibrate(mass)[:, LAST].mean(axis=(1, 2))
    bm = bm25_scores(ex.question, [f"{d['title']}. {d['text']}" for d in docs])
    retriever = -np.arange(n_docs, dtype=np.float64)
    methods = {"raw attention": raw, "calibrated attention (FITM)": cal, "rag-opt": sc.doc, "BM25": bm}
    methods["retriever order"] = retriever
    return {name: rank_of_gold(np.asarray(s, dtype=np.float64), gold_at) for name, s in methods.items()}


def run_kv(proxy: ProxyModel, n_keys: int, questions: int, positions: list[int]) -> dict[str, Any]:
    path = data_dir() / "lost_in_the_middle" / "kv_retrieval_data" / f"kv-retrieval-{n_keys}_keys.jsonl.gz"
    recs = list(read_jsonl(path))[:questions]
    out: dict[str, Any] = {}
    profile_total: np.ndarray | None = None
    rows: list[tuple[int, np.ndarray, str]] = []
    for pos in positions:
        for rec in recs:
            kv = [tuple(p) for p in rec["ordered_kv_records"]]  # type: ignore[union-attr]
            gold = (rec["key"], rec["value"])
            kv = [p for p in kv if p[0] != gold[0]]
            kv.insert(pos, gold)
            units = [[f'"{k}": "{v}",\n'] for k, v in kv]
            feats = extract(proxy, units, f'Key: "{gold[0]}"\nCorresponding value:', max_tokens=8192)
            mass = feats.doc_mass[:, LAST].mean(axis=(1, 2))
            rows.append((pos, mass, str(gold[0])))
            profile_total = mass if profile_total is None else profile_total + mass
    assert profile_total is not None
    baseline = profile_total / len(rows)  # leave-in mean over all contexts: the positional profile
    for pos in positions:
        raw_ranks = [rank_of_gold(m, pos) for p, m, _ in rows if p == pos]
        cal_ranks = [rank_of_gold(m - baseline, pos) for p, m, _ in rows if p == pos]
        out[str(pos)] = {"raw_mean_rank": float(np.mean(raw_ranks)), "calibrated_mean_rank": float(np.mean(cal_ranks))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-docs", default="10,20,30")
    ap.add_argument("--questions", type=int, default=20, help="NQ test questions per gold position")
    ap.add_argument("--calibration-contexts", type=int, default=50)
    ap.add_argument("--kv-questions", type=int, default=0, help="key-value retrieval questions per position (0: skip)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(RESULTS / "position"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from tqdm.auto import tqdm

    sentinel = SentinelCompressor.from_model(args.model, max_tokens=8192)
    records = nq_split(read_nq_multidoc(data_dir() / "nq_multidoc" / "public.jsonl.gz"), "test")
    results: dict[str, Any] = {"questions_per_position": args.questions, "n_docs": {}}
    for n_docs in (int(x) for x in args.n_docs.split(",")):
        prof = profile_for(sentinel.proxy, n_docs, args.calibration_contexts)
        eligible = [ex for ex in records if len(ex.distractors) >= n_docs - 1][: args.questions]
        per_pos: dict[str, dict[str, dict[str, float]]] = {}
        for gold_at in GRID[n_docs]:
            ranks: dict[str, list[int]] = {}
            for ex in tqdm(eligible, desc=f"N={n_docs} gold@{gold_at}", mininterval=10):
                for name, r in run_nq(sentinel, ex, n_docs, gold_at, prof).items():
                    ranks.setdefault(name, []).append(r)
            per_pos[str(gold_at)] = {
                name: {"recall@1": float(np.mean(np.array(r) <= 1)), "recall@3": float(np.mean(np.array(r) <= 3))}
                for name, r in ranks.items()
            }
        spread = {}
        for name in next(iter(per_pos.values())):
            r3 = [per_pos[p][name]["recall@3"] for p in per_pos]
            spread[name] = min(r3) / max(r3) if max(r3) > 0 else 0.0
        results["n_docs"][str(n_docs)] = {
            "positions": per_pos,
            "recall@3_min_over_max": spread,
            "slot_attention": prof.slot_attention("last").tolist(),
            "profile_contexts": prof.contexts,
        }
    if args.kv_questions:
        results["kv_retrieval_75"] = run_kv(sentinel.proxy, 75, args.kv_questions, [0, 24, 49, 74])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    for n, res in results["n_docs"].items():
        print(f"N={n} documents, {args.questions} NQ test questions per gold position: Recall@3 by gold position")
        names = list(res["recall@3_min_over_max"])
        print(f"{'method':<30}" + "".join(f"{'@' + p:>8}" for p in res["positions"]) + f"{'min/max':>9}")
        for name in names:
            vals = "".join(f"{res['positions'][p][name]['recall@3']:>8.2f}" for p in res["positions"])
            print(f"{name:<30}{vals}{res['recall@3_min_over_max'][name]:>9.2f}")
        print("slot attention (U-curve): " + " ".join(f"{x:.3f}" for x in res["slot_attention"]))
    if "kv_retrieval_75" in results:
        print("key-value retrieval (75 keys), mean gold rank raw vs calibrated:", results["kv_retrieval_75"])


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = list(results["n_docs"])
    fig, axes = plt.subplots(1, len(ns) + 1, figsize=(5 * (len(ns) + 1), 4))
    axes = np.atleast_1d(axes)
    for ax, n in zip(axes, ns, strict=False):
        res = results["n_docs"][n]
        pos = [int(p) for p in res["positions"]]
        for name in res["recall@3_min_over_max"]:
            ax.plot(pos, [res["positions"][str(p)][name]["recall@3"] for p in pos], marker="o", label=name)
        ax.set_title(f"{n} documents")
        ax.set_xlabel("gold position")
        ax.set_ylabel("Recall@3")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for n in ns:
        ax.plot(results["n_docs"][n]["slot_attention"], marker=".", label=f"N={n}")
    ax.set_title("attention per slot (non-relevant documents)")
    ax.set_xlabel("slot")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
