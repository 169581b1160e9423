"""Position bias of document relevance on the Lost-in-the-Middle NQ setting (and key-value retrieval).

For N documents with the gold passage at each position of the lost-in-the-middle grid, rank the documents by
  - raw attention: share of the final token's attention on each document, mean over layers and heads;
  - FITM-calibrated attention: the same minus the per-slot share measured with non-relevant documents;
  - rag-opt: the document relevance ``optimize()`` reports — the document probe over position-calibrated
    per-head attention plus lexical features (``rag_opt.compressors.doc_relevance``);
  - best sentence: the sentence probe's best sentence per document (rag-opt's uncalibrated fallback);
  - BM25 over the rendered document ("title\\ntext");
  - retriever order (the input order);
and report gold Recall@1 / Recall@3 per gold position, the spread across positions (min/max of Recall@3) and the
raw attention each slot receives (the U-curve). Questions come from the NQ ``test`` split (the document probe
trains on the ``train`` split, profiles come from the ``calibration`` split: no overlap). Attention features are
cached on disk, so re-running (e.g. with another probe via ``--compare-probe``) costs no forward pass.

    python benchmarks/position.py --n-docs 10,20,30 --questions 10:30,20:30,30:12 --kv-questions 8
        # → benchmarks/results/position.{json,png}
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
from common import data_dir

from rag_opt.artifacts.position_profiles import PositionProfile, ProfileStore
from rag_opt.compressors.doc_relevance import document_relevance
from rag_opt.compressors.document_orders import mean_log_odds
from rag_opt.compressors.features import build_features
from rag_opt.compressors.lexical import bm25_scores
from rag_opt.compressors.probe import Probe, shipped_probe
from rag_opt.models.extract import extract
from rag_opt.models.loader import ProxyModel, load_proxy_model
from rag_opt.models.prompt import VIEWS
from rag_opt.paths import cache_dir
from rag_opt.text.units import UnitTable
from rag_opt.training.calibration import estimate_profile, nq_calibration_contexts
from rag_opt.training.datasets import read_jsonl
from rag_opt.training.doc_probe import nq_cache
from rag_opt.training.feature_cache import FeatureCache
from rag_opt.training.nq_contexts import NQInstance, extract_nq, nq_records

logger = logging.getLogger("bench.position")
RESULTS = Path(__file__).resolve().parent / "results"
GRID = {10: [0, 4, 9], 20: [0, 4, 9, 14, 19], 30: [0, 4, 9, 14, 19, 24, 29]}
LAST = VIEWS.index("last")
TWO_READINGS = "rag-opt, two readings (passes=2)"


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


def nq_method_scores(
    inst: NQInstance,
    attn: Any,
    prof: PositionProfile,
    doc_probe: Probe,
    sentence_probe: Probe | None,
    compare: dict[str, Probe],
) -> dict[str, np.ndarray]:
    q = inst.example.question
    units = inst.units()
    mass = attn.doc_mass.astype(np.float64)  # (n_docs, views, L, H)
    best = None  # the sentence probe's best logit per document (what optimize() gives the document probe)
    if sentence_probe is not None:
        cu = UnitTable.titled(units)
        best = cu.doc_best(sentence_probe.unit_logits(build_features(sentence_probe.layout, attn, q, cu), cu))
    out = {
        "raw attention": mass[:, LAST].mean(axis=(1, 2)),
        "calibrated attention (FITM)": prof.calibrate(mass)[:, LAST].mean(axis=(1, 2)),
        "rag-opt (doc probe, calibrated)": document_relevance(doc_probe, attn, q, units, prof, best_sentence=best),
    }
    for label, probe in compare.items():
        out[label] = document_relevance(probe, attn, q, units, prof, best_sentence=best)
    if best is not None:
        out["best sentence (sentence probe)"] = best
    out["BM25"] = bm25_scores(q, ["".join(u) for u in units])
    out["retriever order"] = -np.arange(inst.n_docs, dtype=np.float64)
    return out


def reversed_scores(
    inst: NQInstance, attn: Any, prof: PositionProfile, doc_probe: Probe, sentence_probe: Probe | None
) -> np.ndarray:
    """rag-opt's document relevance from the reading with the documents reversed (in that reversed order)."""
    units = inst.units()[::-1]
    q = inst.example.question
    best = None
    if sentence_probe is not None:
        cu = UnitTable.titled(units)
        best = cu.doc_best(sentence_probe.unit_logits(build_features(sentence_probe.layout, attn, q, cu), cu))
    return document_relevance(doc_probe, attn, q, units, prof, best_sentence=best)


def run_nq(
    proxy: ProxyModel,
    n_docs: int,
    questions: int,
    cache_root: str,
    prof: PositionProfile,
    doc_probe: Probe,
    sentence_probe: Probe | None,
    compare: dict[str, Probe],
    two_readings: bool = False,
) -> dict[str, Any]:
    records = nq_records(data_dir() / "nq_multidoc" / "public.jsonl.gz", "test")[:questions]
    insts = [NQInstance(ex, n_docs, g) for g in GRID[n_docs] for ex in records]
    # a sentence probe that reads cross-document attention needs features extracted with it (a cache of their own)
    cross = sentence_probe is not None and sentence_probe.layout.needs_cross
    cache = nq_cache(cache_root, proxy.name, "test", n_docs)
    if cross:
        cache = FeatureCache(cache.root.with_name(cache.root.name + "-cross"))
    extract_nq(insts, cache, proxy, desc=f"NQ test, {n_docs} documents", cross=cross)
    feats = cache.load(i.id for i in insts)
    reversed_feats: dict[str, Any] = {}
    if two_readings:  # the same contexts with the documents reversed: SentinelCompressor(passes=2)'s second reading
        from rag_opt.models.extract import extract
        from rag_opt.training.feature_cache import fill_cache

        todo = [(f"{i.id}-reversed", i.units()[::-1], i.example.question) for i in insts]
        fill_cache(
            cache,
            todo,
            lambda contexts: [extract(proxy, d, q, max_tokens=8192, cross=cross) for d, q in contexts],
            shard_size=20,
            desc=f"NQ test, {n_docs} documents reversed",
        )
        reversed_feats = cache.load(t[0] for t in todo)
    per_pos: dict[str, dict[str, dict[str, float]]] = {}
    for gold_at in GRID[n_docs]:
        ranks: dict[str, list[int]] = {}
        for inst in insts:
            if inst.gold_at != gold_at:
                continue
            scores = nq_method_scores(inst, feats[inst.id], prof, doc_probe, sentence_probe, compare)
            if two_readings:
                second = reversed_scores(inst, reversed_feats[f"{inst.id}-reversed"], prof, doc_probe, sentence_probe)
                scores[TWO_READINGS] = mean_log_odds(scores["rag-opt (doc probe, calibrated)"], second[::-1])
            for name, s in scores.items():
                ranks.setdefault(name, []).append(rank_of_gold(np.asarray(s, dtype=np.float64), gold_at))
        per_pos[str(gold_at)] = {
            name: {"recall@1": float(np.mean(np.array(r) <= 1)), "recall@3": float(np.mean(np.array(r) <= 3))}
            for name, r in ranks.items()
        }
    spread = {}
    for name in next(iter(per_pos.values())):
        r3 = [per_pos[p][name]["recall@3"] for p in per_pos]
        spread[name] = min(r3) / max(r3) if max(r3) > 0 else 0.0
    return {
        "questions_per_position": len(records),
        "positions": per_pos,
        "recall@3_min_over_max": spread,
        "slot_attention": prof.slot_attention("last").tolist(),
        "profile_contexts": prof.contexts,
    }


def run_kv(proxy: ProxyModel, n_keys: int, questions: int, positions: list[int], cache_root: str) -> dict[str, Any]:
    """Mean rank of the queried key-value pair by raw vs calibrated attention: the final token's, averaged over all
    layers and heads, and averaged over the model's retrieval heads (``AttentionSort.tuned``'s).

    The positional profile is measured on the same kind of context with a query key that is *not* in the list
    (every slot non-relevant), on records other than the measured ones. Features are cached like NQ's."""
    from rag_opt.training.feature_cache import fill_cache
    from rag_opt.training.sentence_probe import feature_cache_for

    path = data_dir() / "lost_in_the_middle" / "kv_retrieval_data" / f"kv-retrieval-{n_keys}_keys.jsonl.gz"
    recs = list(read_jsonl(path))[: 2 * questions]
    measured, held = recs[:questions], recs[questions:]

    def pairs(rec: dict[str, Any]) -> list[tuple[str, str]]:
        return [(str(k), str(v)) for k, v in rec["ordered_kv_records"]]

    def units(kv: list[tuple[str, str]]) -> list[list[str]]:
        return [[f'"{k}": "{v}",\n'] for k, v in kv]

    def query(key: str) -> str:
        return f'Key: "{key}"\nCorresponding value:'

    todo: list[tuple[str, list[list[str]], str]] = []
    for i, rec in enumerate(held):  # absent key: another measured record's key
        todo.append((f"base{i}", units(pairs(rec)), query(str(measured[i % len(measured)]["key"]))))
    for pos in positions:
        for i, rec in enumerate(measured):
            gold = (str(rec["key"]), str(rec["value"]))
            kv = [p for p in pairs(rec) if p[0] != gold[0]]
            kv.insert(pos, gold)
            todo.append((f"q{i}-g{pos}", units(kv), query(gold[0])))
    cache = feature_cache_for(cache_root, proxy.name, f"kv-{n_keys}")
    fill_cache(
        cache,
        todo,
        lambda contexts: [extract(proxy, d, q, max_tokens=8192) for d, q in contexts],
        shard_size=10,
        desc="key-value",
    )
    feats = cache.load(t[0] for t in todo)

    probe = shipped_probe(proxy.name, "document")
    heads = (probe.metadata.get("attention_sort") if probe is not None else None) or {}

    def scores(key: str, kind: str) -> np.ndarray:
        m = feats[key].doc_mass.astype(np.float64)
        if kind == "all heads":
            return np.asarray(m[:, LAST].mean(axis=(1, 2)))
        v = VIEWS.index(heads["view"])
        return np.asarray(np.mean([m[:, v, a, b] for a, b in heads["head_pairs"]], axis=0))

    kinds = ["all heads"] + (["retrieval heads"] if heads else [])
    out: dict[str, Any] = {"questions_per_position": questions, "profile_contexts": len(held), "positions": {}}
    if heads:
        out["retrieval_heads"] = heads
    for kind in kinds:
        baseline = np.mean([scores(f"base{i}", kind) for i in range(len(held))], axis=0)
        for pos in positions:
            raw_r = [rank_of_gold(scores(f"q{i}-g{pos}", kind), pos) for i in range(len(measured))]
            cal_r = [rank_of_gold(scores(f"q{i}-g{pos}", kind) - baseline, pos) for i in range(len(measured))]
            out["positions"].setdefault(str(pos), {})[kind] = {
                "raw_mean_rank": float(np.mean(raw_r)),
                "calibrated_mean_rank": float(np.mean(cal_r)),
                "raw_recall@1": float(np.mean(np.array(raw_r) <= 1)),
                "calibrated_recall@1": float(np.mean(np.array(cal_r) <= 1)),
            }
        if kind == "all heads":
            out["slot_attention"] = baseline.tolist()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-docs", default="10,20,30")
    ap.add_argument(
        "--questions",
        default="30",
        help="NQ test questions per gold position: one number, or per N as 10:30,20:30,30:12",
    )
    ap.add_argument("--calibration-contexts", type=int, default=30, help="contexts for a profile built here")
    ap.add_argument("--kv-questions", type=int, default=0, help="key-value retrieval questions per position (0: skip)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None, help="proxy precision (features cached per precision)")
    ap.add_argument("--sentence-probe", default=None, help="sentence probe JSON (default: the shipped one)")
    ap.add_argument("--doc-probe", default=None, help="document probe JSON (default: the shipped one)")
    ap.add_argument("--compare-probe", action="append", default=[], help="LABEL=PATH: also rank with this probe")
    ap.add_argument("--cache", default=str(cache_dir() / "features"), help="attention feature cache folder")
    ap.add_argument(
        "--two-readings",
        default="",
        help="comma-separated N: also rank with SentinelCompressor(passes=2), a second reading of each context with "
        "the documents reversed (one more forward pass per context)",
    )
    ap.add_argument("--out", default=str(RESULTS / "position"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    nq = data_dir() / "nq_multidoc" / "public.jsonl.gz"
    if not nq.is_file():
        sys.exit(f"NQ multi-document data not found at {nq} (set RAG_OPT_DATA_DIR or check ../shared/data)")

    proxy = load_proxy_model(args.model, dtype=args.dtype)
    if args.dtype:
        args.cache = str(Path(args.cache) / args.dtype)
    doc_probe = Probe.load(args.doc_probe) if args.doc_probe else shipped_probe(proxy.name, "document")
    if doc_probe is None:
        sys.exit(f"no document probe for {proxy.name}: train one with `rag-opt train-doc-probe` and pass --doc-probe")
    compare = {}
    for spec in args.compare_probe:
        label, _, path = spec.partition("=")
        compare[label] = Probe.load(path)
    sentence_probe = Probe.load(args.sentence_probe) if args.sentence_probe else shipped_probe(proxy.name)
    results: dict[str, Any] = {"model": proxy.name, "doc_probe": doc_probe.metadata, "n_docs": {}}
    per_n = dict(x.split(":") for x in args.questions.split(",")) if ":" in args.questions else {}
    for n_docs in (int(x) for x in args.n_docs.split(",") if x.strip() and x.strip() != "none"):
        prof = profile_for(proxy, n_docs, args.calibration_contexts)
        questions = int(per_n.get(str(n_docs), args.questions if not per_n else 30))
        two = str(n_docs) in {x.strip() for x in args.two_readings.split(",")}
        results["n_docs"][str(n_docs)] = run_nq(
            proxy, n_docs, questions, args.cache, prof, doc_probe, sentence_probe, compare, two
        )
    if args.kv_questions:
        results["kv_retrieval_75"] = run_kv(proxy, 75, args.kv_questions, [0, 24, 49, 74], args.cache)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(report(results))


def report(results: dict[str, Any]) -> str:
    lines = []
    for n, res in results["n_docs"].items():
        q = res["questions_per_position"]
        lines.append(
            f"\nN={n} documents, {q} NQ test questions per gold position: Recall@3 (Recall@1) by gold position"
        )
        names = list(res["recall@3_min_over_max"])
        lines.append(f"{'method':<34}" + "".join(f"{'@' + p:>12}" for p in res["positions"]) + f"{'min/max':>9}")
        for name in names:
            cells = "".join(
                f"{res['positions'][p][name]['recall@3']:>6.2f} ({res['positions'][p][name]['recall@1']:.2f})"
                for p in res["positions"]
            )
            lines.append(f"{name:<34}{cells}{res['recall@3_min_over_max'][name]:>9.2f}")
        lines.append("slot attention (U-curve): " + " ".join(f"{x:.3f}" for x in res["slot_attention"]))
    kv = results.get("kv_retrieval_75")
    if kv:
        lines.append(
            f"\nkey-value retrieval (75 pairs, {kv['questions_per_position']} per position): mean gold rank (Recall@1)"
        )
        kinds = list(next(iter(kv["positions"].values())))
        lines.append(f"{'gold position':<16}" + "".join(f"{k + ' raw':>24}{k + ' calibrated':>30}" for k in kinds))
        for p, r in kv["positions"].items():
            cells = "".join(
                f"{r[k]['raw_mean_rank']:>17.1f} ({r[k]['raw_recall@1']:.2f}){r[k]['calibrated_mean_rank']:>23.1f} "
                f"({r[k]['calibrated_recall@1']:.2f})"
                for k in kinds
            )
            lines.append(f"{p:<16}{cells}")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = list(results["n_docs"])
    fig, axes = plt.subplots(1, len(ns) + 1, figsize=(5 * (len(ns) + 1), 4.2))
    axes = np.atleast_1d(axes)
    for ax, n in zip(axes, ns, strict=False):
        res = results["n_docs"][n]
        pos = [int(p) for p in res["positions"]]
        for name in res["recall@3_min_over_max"]:
            ax.plot(
                [p + 1 for p in pos],
                [res["positions"][str(p)][name]["recall@3"] for p in pos],
                marker="o",
                lw=2.5 if name.startswith("rag-opt") else 1.2,
                label=name,
            )
        ax.set_title(f"{n} documents ({res['questions_per_position']} questions / position)")
        ax.set_xlabel("gold document position (1-based)")
        ax.set_ylabel("gold Recall@3")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for n in ns:
        curve = results["n_docs"][n]["slot_attention"]
        ax.plot(np.arange(1, len(curve) + 1), np.asarray(curve) * len(curve), marker=".", label=f"N={n}")
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_title("final-token attention per slot, non-relevant docs\n(× N: 1 = even share)")
    ax.set_xlabel("slot (1-based)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
