"""When is rag-opt's best document clearly the best? Choosing ``promote_clear_best``'s share without the test set.

    python benchmarks/ablations/promote_gate.py            # → results/promote_gate.json (+ .jsonl: resumable)

``ordering="promote_best"`` moves the most relevant document to the front. Where the retriever already put the
right document first, that can only hurt: when the document probe ranks a distractor above it, the distractor moves
in front and answers flip (``benchmarks/litm.py``, slot 1). ``promote_clear_best`` promotes only when the first
document's relevance is at most a share X of the best's, so a first document that the probe finds nearly as good
stays first. What the gate costs is the promotions that help: the gold passage brought forward from slots 5..N.

This picks X on the NQ multi-document **calibration** split (index % 10 == 0: neither the document probe's training
data nor the test questions ``litm.py`` reads), the gold passage at each slot of the paper's grid (1, 5, 10, ... N),
document relevance from one ``optimize(..., ordering="relevance")`` call (the library defaults, the full context).
For each X of ``--shares`` it reports, with the gold passage first, how often a distractor would move in front of it
("slot 1 changed"), and elsewhere how often the gold passage is promoted. The share chosen is the largest whose
slot-1 change rate is at most ``--max-changed`` (default 0.02: at 50 questions a slot, at most one changed context
expected; a lost answer at slot 1 puts ``litm.py``'s CI low at −0.06, past the issue's −0.03).

Every context's relevance is appended to ``results/promote_gate.jsonl`` as it is computed: a stopped run resumes,
and ``--split train`` measures the probe's own training questions for comparison (it is more often right there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir  # noqa: E402
from litm import GRIDS  # noqa: E402  (the paper's slot grids, as the reader benchmark uses them)

from rag_opt.models.encoding_cache import EncodingCache  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.training.datasets import nq_split, read_nq_multidoc  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def promotes(relevance: list[float], share: float) -> int | None:
    """The document ``promote_clear_best`` with ``share`` moves to the front, or None (the input order stays):
    :class:`rag_opt.orderers.PromoteClearBest`'s rule, applied to relevance already computed."""
    from rag_opt.orderers import OrderItem, PromoteClearBest

    perm = PromoteClearBest(share).order("", [OrderItem("", r) for r in relevance]).permutation
    return None if perm[0] == 0 else perm[0]


def rates(rows: list[dict[str, Any]], share: float) -> dict[str, float]:
    """With the gold passage first: the share of contexts a distractor moves in front of it. Elsewhere: the share
    where the gold passage is promoted, and where a distractor is."""
    first = [promotes(r["relevance"], share) is not None for r in rows if r["slot"] == 0]
    moved = [(promotes(r["relevance"], share), r["slot"]) for r in rows if r["slot"] != 0]
    return {
        "slot1_changed": float(np.mean(first)),
        "gold_promoted": float(np.mean([p == s for p, s in moved])),
        "distractor_promoted": float(np.mean([p is not None and p != s for p, s in moved])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="calibration", choices=("calibration", "train"))
    ap.add_argument("--questions", type=int, default=200, help="questions of the split (in file order)")
    ap.add_argument("--n-docs", type=int, default=20, choices=sorted(GRIDS))
    ap.add_argument("--shares", default="1,0.8,0.6,0.5,0.4,0.3,0.2,0.1,0.05,0.02,0.01")
    ap.add_argument("--max-changed", type=float, default=0.02, help="slot-1 change rate the share may cause")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="default results/promote_gate[_<split>][_n<N>].json")
    args = ap.parse_args()
    path = data_dir() / "nq_multidoc" / "public.jsonl.gz"
    if not path.is_file():
        raise SystemExit(f"NQ multi-document data not found at {path} (see ../shared/data/README.md)")
    records = nq_split(read_nq_multidoc(path, min_distractors=args.n_docs - 1), args.split)[: args.questions]
    suffix = ("" if args.split == "calibration" else f"_{args.split}") + (
        "" if args.n_docs == 20 else f"_n{args.n_docs}"
    )
    out = Path(args.out) if args.out else RESULTS / f"promote_gate{suffix}.json"
    cache = out.with_suffix(".jsonl")
    rows = [json.loads(line) for line in cache.read_text().splitlines() if line.strip()] if cache.is_file() else []
    done = {(r["q"], r["slot"]) for r in rows}
    opt = ContextOptimizer(threads=args.threads, cache=EncodingCache())  # each question's documents read once
    with open(cache, "a") as sink:
        for ex in tqdm(records, desc=f"promote gate, {args.split}, N={args.n_docs}"):
            for slot in GRIDS[args.n_docs]:
                if (ex.index, slot) in done:
                    continue
                docs = [{"id": str(j), **d} for j, d in enumerate(ex.documents(args.n_docs, slot))]
                res = opt.optimize(ex.question, docs, ratio=1.0, ordering="relevance")
                score = {d.id: d.score for d in res.documents}
                row = {"q": ex.index, "slot": slot, "relevance": [score[str(j)] for j in range(args.n_docs)]}
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
    asked = {ex.index for ex in records}
    rows = [r for r in rows if r["q"] in asked]
    shares = [float(x) for x in args.shares.split(",")]
    table = {f"{x:g}": rates(rows, x) for x in shares}
    fit = [x for x in shares if table[f"{x:g}"]["slot1_changed"] <= args.max_changed]
    chosen = max(fit) if fit else None
    top_is_gold = float(np.mean([int(np.argmax(r["relevance"])) == r["slot"] for r in rows]))
    res = {
        "data": f"nq_multidoc {args.split} split, first {len(asked)} questions, {args.n_docs} documents, "
        f"gold at slots {[s + 1 for s in GRIDS[args.n_docs]]}",
        "contexts": len(rows),
        "top_is_gold": top_is_gold,
        "max_changed": args.max_changed,
        "shares": table,
        "chosen": chosen,
    }
    out.write_text(json.dumps(res, indent=1))
    print(f"{res['data']}; the best document is the gold passage in {top_is_gold:.3f} of contexts")
    print(f"{'share':>6s} {'slot 1 changed':>15s} {'gold promoted':>14s} {'distractor promoted':>20s}")
    for key, r in table.items():
        print(f"{key:>6s} {r['slot1_changed']:15.3f} {r['gold_promoted']:14.3f} {r['distractor_promoted']:20.3f}")
    print(f"chosen: {chosen} (the largest share changing at most {args.max_changed} of slot-1 contexts)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
