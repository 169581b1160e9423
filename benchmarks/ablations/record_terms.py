"""Lookups in structured tool results: is the record the question names kept, with rows read as prose or as records?

    OMP_NUM_THREADS=1 python benchmarks/ablations/record_terms.py  # results/record_terms.json

A tool result of 60 product records (``{"id", "name": "item k", "category", "price", "stock"}``), as a JSON array
and as a CSV table, and questions that name one record ("How much does item 7 cost?", "What is the stock of item
7?", "Which category is item 7 in?", "item 7 price", "Tell me about item number 7."), each at a budget of 10
target tokens (less than one record: the best-scored row decides). A lookup counts when the kept text holds the
named record (its id and its price in one kept row). Two arms, both tiers:

* ``records``: rag-opt as shipped; a structured row's lexical features read every term, single characters too, and
  pairs of adjacent terms (``rag_opt.compressors.lexical.RECORD_TERMS``), with no position prior;
* ``as prose``: rows read like prose sentences (words of two characters or more; the first row of a document gets
  the lead-sentence features), what rag-opt did before.

The model tier scores each structured row by its lexical score (``rag_opt.compressors.structured``; until
2026-12-05 the higher of the probe's and the lexical one), so both arms differ only in the lexical features of
structured rows.

The rule was worked out on the product lookups; the second data set, written after it was fixed, checks it on
another shape: 26 buildings named by a letter ("Building C") and 20 towers by a number ("Tower 7") in one JSON
array, "What is the phone number of Building C?", 12 target tokens, counted when the kept text holds its phone.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "results"
QUESTIONS = (
    "How much does item {k} cost?",
    "What is the stock of item {k}?",
    "Which category is item {k} in?",
    "item {k} price",
    "Tell me about item number {k}.",
)
CATEGORIES = ("tools", "garden", "kitchen")
RECORDS = [
    {"id": i, "name": f"item {i}", "category": CATEGORIES[i % 3], "price": round(3.5 + i * 1.25, 2)}
    | {"stock": i * 7 % 50}
    for i in range(1, 61)
]
BUDGET = 10
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
BUILDINGS = [
    {"building": f"Building {c}", "manager": f"Manager {i + 100}", "floors": (i * 5) % 9 + 1}
    | {"phone": f"555-{2000 + i * 37}"}
    for i, c in enumerate(LETTERS)
] + [
    {"building": f"Tower {d}", "manager": f"Manager {d + 200}", "floors": d % 4 + 2, "phone": f"555-{3000 + d * 41}"}
    for d in range(1, 21)
]
BUILDING_BUDGET = 12
logger = logging.getLogger("record_terms")


def documents() -> dict[str, str]:
    csv = "id,name,category,price,stock\n" + "\n".join(
        f"{r['id']},{r['name']},{r['category']},{r['price']:.2f},{r['stock']}" for r in RECORDS
    )
    return {"json": json.dumps(RECORDS, indent=2), "csv": csv}


def kept_record(result: Any, text: str, fmt: str, k: int) -> bool:
    price = f"{RECORDS[k - 1]['price']:.2f}" if fmt == "csv" else json.dumps(RECORDS[k - 1]["price"])
    row = f"{k},item {k}," if fmt == "csv" else f'"id": {k},'
    kept = [text[u.start : u.end] for d in result.documents for u in d.units if u.kept]
    return any(row in unit and price in unit for unit in kept)


@contextmanager
def as_prose() -> Iterator[None]:
    """Rows' lexical features computed as prose's (no row is structured to ``lexical_features``)."""
    with mock.patch("rag_opt.compressors.features.structured_rows", lambda units: np.zeros(units.n_units, dtype=bool)):
        yield


def run() -> dict[str, Any]:
    from tqdm.auto import tqdm

    from rag_opt.pipeline import ContextOptimizer

    docs = documents()
    buildings = json.dumps(BUILDINGS, indent=2)
    tiers = {"lexical": ContextOptimizer(tier="lexical"), "model": ContextOptimizer()}
    cells: dict[str, Any] = {}
    for tier, opt in tiers.items():
        for arm in ("records", "as prose"):
            missed: dict[str, list[Any]] = {}
            with as_prose() if arm == "as prose" else _nothing():
                for q in tqdm(QUESTIONS, desc=f"{tier}, {arm}", mininterval=10):
                    for fmt, text in docs.items():
                        missed[f"{fmt}: {q}"] = [
                            k
                            for k in range(1, len(RECORDS) + 1)
                            if not kept_record(opt.optimize(q.format(k=k), [text], target_tokens=BUDGET), text, fmt, k)
                        ]
                lost = []
                for b in BUILDINGS:
                    result = opt.optimize(
                        f"What is the phone number of {b['building']}?", [buildings], target_tokens=BUILDING_BUDGET
                    )
                    if not any(
                        b["phone"] in buildings[u.start : u.end] for d in result.documents for u in d.units if u.kept
                    ):
                        lost.append(b["building"])
            lookups = len(missed) * len(RECORDS)
            n_missed = sum(len(v) for v in missed.values())
            cells[f"{tier} / {arm}"] = {"kept": (lookups - n_missed) / lookups, "lookups": lookups, "missed": missed}
            cells[f"{tier} / {arm} / buildings"] = {
                "kept": 1 - len(lost) / len(BUILDINGS),
                "lookups": len(BUILDINGS),
                "missed": {"json: What is the phone number of {building}?": lost},
            }
    return {"budget_tokens": BUDGET, "building_budget_tokens": BUILDING_BUDGET, "records": len(RECORDS), "cells": cells}


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "record_terms.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run()
    for name, c in res["cells"].items():
        worst = {q: v for q, v in c["missed"].items() if v}
        logger.info(
            "%-22s record kept in %.3f of %d lookups; missed: %s", name, c["kept"], c["lookups"], worst or "none"
        )
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
