"""Position bias under parallel encoding, on the Lost-in-the-Middle NQ setting, with one reading.

The same questions (NQ ``test`` split) and gold-position grid as ``benchmarks/position.py``: for N documents with the
gold passage at every grid slot, rank the documents and report gold Recall@1 / Recall@3 per slot. Ranked by

  - rag-opt under parallel encoding: what ``optimize(encoding="parallel")`` reports as document relevance (the
    document probe when one is shipped for the encoding, else the sentence probe's best sentence per document);
  - BM25 over the rendered document ("title\\ntext").

It also checks the claim behind it: under parallel encoding a document's features do not depend on its slot, so
per question the largest difference between the per-document scores with the gold passage at any two slots is
reported (it is float rounding). Document encodings are cached across slots and across N (the N = 10 and 20
contexts are subsets of the N = 30 one), so each document is encoded once.

The joint encoding's figures (one and two readings) are those of ``benchmarks/position.py``, in
``benchmarks/results/position.json``; this script prints them beside its own when that file is there.

    python benchmarks/position_parallel.py --n-docs 10,20,30 --questions 30  # → results/position_parallel.json
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from common import data_dir, run_or_report
from position import GRID, rank_of_gold

from rag_opt.compressors.doc_relevance import document_relevance
from rag_opt.compressors.features import build_features
from rag_opt.compressors.lexical import bm25_scores
from rag_opt.compressors.probe import Probe, shipped_probe
from rag_opt.models.encoding_cache import EncodingCache
from rag_opt.models.extract import extract_batch
from rag_opt.models.loader import load_proxy_model
from rag_opt.text.units import UnitTable
from rag_opt.training.nq_contexts import NQInstance, nq_records

logger = logging.getLogger("bench.position_parallel")
RESULTS = Path(__file__).resolve().parent / "results"
RAG_OPT = "rag-opt (parallel, one reading)"


def scores(inst: NQInstance, attn: Any, sentence: Probe, doc_probe: Probe | None) -> dict[str, np.ndarray]:
    q = inst.example.question
    units = inst.units()
    table = UnitTable.titled(units)
    best = table.doc_best(sentence.unit_logits(build_features(sentence.layout, attn, q, table), table))
    ours = document_relevance(doc_probe, attn, q, units, None, best_sentence=best) if doc_probe else best
    return {RAG_OPT: np.asarray(ours, dtype=np.float64), "BM25": bm25_scores(q, ["".join(u) for u in units])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    proxy = load_proxy_model(args.model, dtype=args.dtype)
    sentence = Probe.load(args.sentence_probe) if args.sentence_probe else shipped_probe(proxy.name, "unit", "parallel")
    if sentence is None:
        raise SystemExit("no sentence probe for the parallel encoding: pass --sentence-probe")
    doc_probe = Probe.load(args.doc_probe) if args.doc_probe else shipped_probe(proxy.name, "document", "parallel")
    depth = max(p.layout.num_layers for p in (sentence, doc_probe) if p is not None)
    sizes = sorted(int(x) for x in args.n_docs.split(","))
    records = nq_records(data_dir() / "nq_multidoc" / "public.jsonl.gz", "test")[: args.questions]
    cache = EncodingCache(max_bytes=4 * 2**30)
    ranks: dict[int, dict[int, dict[str, list[int]]]] = {n: {g: {} for g in GRID[n]} for n in sizes}
    slot_spread: dict[int, list[float]] = {n: [] for n in sizes}
    for ex in tqdm(records, desc="NQ test questions", mininterval=10):
        cache.clear()
        for n in sorted(sizes, reverse=True):  # the largest first: its documents cover the smaller contexts
            insts = [NQInstance(ex, n, g) for g in GRID[n]]
            feats = extract_batch(
                proxy,
                [(i.units(), ex.question) for i in insts],
                layers=depth,
                encoding="parallel",
                cache=cache,
                cross=sentence.layout.needs_cross,  # the cross-document reading, when the sentence probe reads it
            )
            per_doc = []
            for inst, attn in zip(insts, feats, strict=True):
                s = scores(inst, attn, sentence, doc_probe)
                for name, v in s.items():
                    ranks[n][inst.gold_at].setdefault(name, []).append(rank_of_gold(v, inst.gold_at))
                # back to a fixed document order (the gold passage first, then the distractors) to compare slots
                order = [inst.gold_at] + [d for d in range(n) if d != inst.gold_at]
                per_doc.append(s[RAG_OPT][order])
            slot_spread[n].append(float(np.max(np.ptp(np.stack(per_doc), axis=0))))
    out: dict[str, Any] = {
        "model": proxy.name,
        "dtype": str(proxy.dtype).removeprefix("torch."),
        "sentence_probe": args.sentence_probe or "shipped (parallel)",
        "doc_probe": args.doc_probe or ("shipped (parallel)" if doc_probe else "none: best sentence"),
        "questions": len(records),
        "n_docs": {},
    }
    for n in sizes:
        per_pos = {
            str(g): {
                name: {"recall@1": float(np.mean(np.array(r) <= 1)), "recall@3": float(np.mean(np.array(r) <= 3))}
                for name, r in ranks[n][g].items()
            }
            for g in GRID[n]
        }
        out["n_docs"][str(n)] = {
            "positions": per_pos,
            "max_score_difference_across_slots": max(slot_spread[n]),
        }
    return out


def joint_reference(n: int) -> dict[str, Any] | None:
    path = RESULTS / "position.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text()).get("n_docs", {}).get(str(n))
    return data.get("positions") if data else None


def print_table(res: dict[str, Any]) -> None:
    print(f"{res['questions']} NQ test questions per slot; document relevance: {res['doc_probe']}")
    for n, r in res["n_docs"].items():
        joint = joint_reference(int(n))
        print(f"\n{n} documents (largest score difference across slots: {r['max_score_difference_across_slots']:.2e})")
        head = f"{'slot':>5} {'parallel R@1':>13} {'parallel R@3':>13} {'BM25 R@3':>9}"
        if joint:
            head += f" {'joint R@3':>10} {'joint 2 readings R@3':>21}"
        print(head)
        for g, m in r["positions"].items():
            line = (
                f"{int(g) + 1:>5} {m[RAG_OPT]['recall@1']:13.2f} {m[RAG_OPT]['recall@3']:13.2f} "
                f"{m['BM25']['recall@3']:9.2f}"
            )
            if joint and g in joint:
                j = joint[g]
                one = j.get("rag-opt (doc probe, calibrated)", {}).get("recall@3", float("nan"))
                two = j.get("rag-opt, two readings (passes=2)", {}).get("recall@3", float("nan"))
                line += f" {one:10.2f} {two:21.2f}"
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-docs", default="10,20,30")
    ap.add_argument("--questions", type=int, default=30)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--sentence-probe", default=None, help="sentence probe JSON (default: shipped for parallel)")
    ap.add_argument("--doc-probe", default=None, help="document probe JSON (default: shipped for parallel, if any)")
    ap.add_argument("--out", default=str(RESULTS / "position_parallel.json"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run_or_report(Path(args.out), args.report_only, lambda: run(args), print_table)


if __name__ == "__main__":
    main()
