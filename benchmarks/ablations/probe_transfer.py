"""Does a candidate sentence probe hold off HotpotQA? Paired against the shipped probe, on the same contexts.

    OMP_NUM_THREADS=1 python benchmarks/ablations/probe_transfer.py --probe probe.json --squad 300 --records 20 \
        --out benchmarks/results/hidden_layer/transfer.json

A probe trained on HotpotQA (and NQ) contexts can score those better and others worse: the hidden-layer first stage
(``rag-opt train-probe --hidden 64``, ``docs/research-log.md``) gained on HotpotQA dev and lost SQuAD answers at 1/5.
This script measures a candidate probe (``--probe``, a probe JSON for the embedded proxy and parallel encoding)
against the shipped one (each arm with the shipped document probe), question by question, where it was not
trained:

* ``--squad N``: N answerable SQuAD 2.0 dev questions, each with its paragraph among four others of the same article
  (``benchmarks/compression.py``'s setting); the answer sentence kept and the answer kept at 1/3 and 1/5;
* ``--records K``: K lookups in a JSON list of 60 product records and in the same records as CSV ("How much does item
  k cost?", k drawn with a fixed seed), with a budget of 10 target tokens (less than one record): the asked record
  kept. Structured rows score their lexical score (``rag_opt.compressors.structured.with_lexical_rows``; until
  2026-12-05 the higher of the probe's and the lexical score, so a probe sure of every record overrode the lexical
  scores);
* ``--nq N`` (optional): N questions of the NQ multi-document test split (never trained on), 20 documents each with
  the gold passage at a random slot (fixed seed), single-hop Wikipedia passages as retrieved: an answer kept at 1/3
  and 1/5 (the setting ``benchmarks/litm.py`` reads);
* ``--hotpot LO:HI`` (optional): HotpotQA dev questions LO to HI of the seeded shuffle, with and without the title
  field, supporting-fact recall and answer kept at 1/3 and 1/5 (never the README's 0:200 when choosing).

Each cell prints both means and the paired difference (candidate minus shipped) with a 95 % bootstrap interval. The
data is read from ``../shared/data``; the script stops with a message when it is absent.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ablations/: record_terms.py
from common import data_dir, paired_bootstrap  # noqa: E402
from compression import hotpot_documents, hotpot_metrics, squad_examples, squad_metrics  # noqa: E402
from record_terms import BUDGET as RECORD_BUDGET  # noqa: E402  (the record lookups of record_terms.py)
from record_terms import RECORDS, kept_record  # noqa: E402
from record_terms import documents as record_documents  # noqa: E402

from rag_opt.compressors import SentinelCompressor  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.training.datasets import read_hotpotqa  # noqa: E402

logger = logging.getLogger("probe_transfer")
RATIOS = (1 / 3, 1 / 5)
NQ_DOCS = 20
ARMS = ("shipped", "candidate")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    arms = {
        "shipped": SentinelCompressor.from_model(None, encoding="parallel"),
        "candidate": SentinelCompressor.from_model(None, encoding="parallel", probe=args.probe),
    }
    opts = {a: ContextOptimizer(scorer=s) for a, s in arms.items()}
    rows: dict[str, dict[str, list[float | None]]] = {}  # cell -> arm -> per-question value

    def add(cell: str, arm: str, value: float | None) -> None:
        rows.setdefault(cell, {a: [] for a in ARMS})[arm].append(value)

    if args.squad:
        for ex in tqdm(squad_examples(args.squad), desc="SQuAD", mininterval=10):
            for arm, opt in opts.items():
                for r in RATIOS:
                    m = squad_metrics(ex, opt.optimize(ex["question"], ex["docs"], ratio=r))
                    for name in ("answer_sentence_kept", "answer_retention"):
                        add(f"squad {r:.2f} {name}", arm, m[name])
    if args.records:
        docs = record_documents()
        ks = random.Random(0).sample(range(1, len(RECORDS) + 1), args.records)
        for k in tqdm(ks, desc="records", mininterval=10):
            for fmt, text in docs.items():
                for arm, opt in opts.items():
                    result = opt.optimize(f"How much does item {k} cost?", [text], target_tokens=RECORD_BUDGET)
                    add(f"records {fmt} record_kept", arm, float(kept_record(result, text, fmt, k)))
    if args.nq:
        from rag_opt.training.datasets import contains_answer
        from rag_opt.training.nq_contexts import nq_records, random_positions

        records = nq_records(data_dir() / "nq_multidoc" / "public.jsonl.gz", "test")[: args.nq]
        for inst in tqdm(random_positions(records, NQ_DOCS, seed=0), desc="NQ", mininterval=10):
            documents = inst.example.documents(NQ_DOCS, inst.gold_at)
            for arm, opt in opts.items():
                for r in RATIOS:
                    kept = opt.optimize(inst.example.question, documents, ratio=r).context()
                    add(
                        f"nq {r:.2f} answer_retention",
                        arm,
                        float(any(contains_answer(kept, a) for a in inst.example.answers)),
                    )
    if args.hotpot:
        lo, hi = (int(x) for x in args.hotpot.split(":"))
        questions = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=hi)[lo:]
        for ex in tqdm(questions, desc="HotpotQA", mininterval=10):
            for regime in ("field", "none"):
                documents, shifts = hotpot_documents(ex, regime)
                for arm, opt in opts.items():
                    for r in RATIOS:
                        m = hotpot_metrics(ex, opt.optimize(ex.question, documents, ratio=r), shifts)
                        for name in ("sf_recall", "answer_retention"):
                            add(f"hotpot {regime} {r:.2f} {name}", arm, m[name])
    cells = {}
    for cell, by_arm in rows.items():
        d = paired_bootstrap(by_arm["shipped"], by_arm["candidate"])
        means = {a: float(np.mean([v for v in by_arm[a] if v is not None])) for a in ARMS}
        cells[cell] = {**means, "diff": d["diff"], "low": d["low"], "high": d["high"], "n": d["n"]}
    return {
        "probe": str(args.probe),
        "squad": args.squad,
        "records": args.records,
        "hotpot": args.hotpot,
        "nq": args.nq,
        "cells": cells,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", required=True, help="the candidate sentence probe (JSON)")
    ap.add_argument("--squad", type=int, default=300, help="SQuAD 2.0 dev questions (0: skip)")
    ap.add_argument("--records", type=int, default=20, help="record lookups in JSON and CSV (0: skip; at most 60)")
    ap.add_argument("--nq", type=int, default=0, help="NQ multi-document test questions, 20 documents (default: skip)")
    ap.add_argument("--hotpot", default=None, help="HotpotQA dev questions LO:HI of the seeded shuffle (default: skip)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not Path(args.probe).is_file():
        raise SystemExit(f"no probe at {args.probe}")
    if not 0 <= args.records <= len(RECORDS):
        raise SystemExit(f"--records must be between 0 and {len(RECORDS)}")
    for sub in ("squad2", "hotpotqa"):
        if not (data_dir() / sub).is_dir():
            raise SystemExit(f"{data_dir() / sub} not found: the real data lives in ../shared/data (see its README)")
    res = run(args)
    for cell, c in res["cells"].items():
        logger.info(
            "%-40s shipped %.3f  candidate %.3f  diff %+.3f [%+.3f, %+.3f]  (n=%d)",
            cell,
            c["shipped"],
            c["candidate"],
            c["diff"],
            c["low"],
            c["high"],
            c["n"],
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
