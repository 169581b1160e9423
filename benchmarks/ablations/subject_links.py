"""Linking documents that have no title by the subject they open with: what it does to compression quality.

    OMP_NUM_THREADS=1 python benchmarks/ablations/subject_links.py --hotpot 200  # results/subject_links.json

The second stage's strongest multi-hop feature, ``named_by_other``, links a sentence that names another document's
title to that document. Documents without a title (``--titles none`` in ``benchmarks/compression.py``) are linked by
the subject their first sentence opens with instead (``rag_opt.text.titles.leading_subject``: ``Dark Horse Records is
a record label`` -> ``Dark Horse Records``). On the first ``--hotpot`` HotpotQA dev questions of the seeded shuffle,
given without titles, the model tier and the lexical tier score each question three times, at 1/3 and 1/5:

* ``links``: the subject and its other names (``rag_opt.text.name_variants``: "Sergey Olegovich Sirotkin" is also
  "Sergey Sirotkin"), and for a document that opens with no subject its salient opening name; what the library does;
* ``subject only``: the subject alone (``UnitTable.link_variants`` and ``link_spans`` emptied);
* ``no links``: neither (``UnitTable.link_names`` emptied too).

The paired differences (links minus no links, and links minus subject only) come with 95 % bootstrap intervals.
The title-field regime on the same questions is the reference the links try to reach.

With ``--titles field`` the questions come with their title field and two arms are paired instead:

* ``links``: the title and, where salient, the subject the text opens with when that is not the title, and its
  other names (``rag_opt.text.name_variants.subject_names``); what the library does;
* ``title only``: the title alone (``UnitTable.link_spans`` emptied).

    OMP_NUM_THREADS=1 python benchmarks/ablations/subject_links.py --titles field --hotpot 200 --offset 400 \
        --out benchmarks/results/subject_links_field.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir, paired_bootstrap  # noqa: E402
from compression import hotpot_documents, hotpot_metrics  # noqa: E402

from rag_opt.compressors import SentinelCompressor  # noqa: E402
from rag_opt.compressors.base import Scores  # noqa: E402
from rag_opt.compressors.lexical_scorer import LexicalScorer  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.text.units import UnitTable  # noqa: E402
from rag_opt.training.datasets import read_hotpotqa  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
RATIOS = (1 / 3, 1 / 5)
METRICS = ("sf_recall", "answer_retention")
ARMS = {"none": ("links", "subject only", "no links"), "field": ("links", "title only")}


class Links:
    """A scorer that reads the documents' link names and their other names (``arm == "links"``), the names alone
    (``"subject only"``) or neither (``"no links"``)."""

    def __init__(self, inner: Any, arm: str) -> None:
        self.inner, self.arm = inner, arm

    def score(self, question: str, units: UnitTable) -> Scores:
        if self.arm == "subject only":
            units = dataclasses.replace(units, link_variants=(), link_spans=())
        elif self.arm == "title only":
            units = dataclasses.replace(units, link_spans=())
        elif self.arm == "no links":
            units = dataclasses.replace(units, link_names=(), link_variants=(), link_spans=())
        return self.inner.score(question, units)


def run(n: int, offset: int = 0, titles: str = "none") -> dict[str, Any]:
    from tqdm.auto import tqdm

    questions = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=offset + n)[offset:]
    sentinel = SentinelCompressor.from_model(None, encoding="parallel")
    tiers = {"model": sentinel, "lexical": LexicalScorer()}
    rows: dict[str, list[dict[str, Any]]] = {}
    for tier, scorer in tiers.items():
        arms = {arm: ContextOptimizer(scorer=Links(scorer, arm)) for arm in ARMS[titles]}
        for ex in tqdm(questions, desc=f"{tier} tier", mininterval=10):
            docs, shifts = hotpot_documents(ex, titles)
            for arm, opt in arms.items():
                for r in RATIOS:
                    m = hotpot_metrics(ex, opt.optimize(ex.question, docs, ratio=r), shifts)
                    rows.setdefault(f"{tier}|{arm}|{r:.3f}", []).append(m)
    out: dict[str, Any] = {"questions": len(questions), "offset": offset, "titles": titles, "results": {}}
    for tier in tiers:
        for r in RATIOS:
            entry: dict[str, Any] = {}
            for metric in METRICS:
                vals = {arm: [x[metric] for x in rows[f"{tier}|{arm}|{r:.3f}"]] for arm in ARMS[titles]}
                b = vals["links"]
                entry[metric] = {
                    arm.replace(" ", "_"): float(np.mean([v for v in v_ if v is not None])) for arm, v_ in vals.items()
                }
                if titles == "field":
                    d = paired_bootstrap(vals["title only"], b)  # with the subject names minus the title alone
                    entry[metric]["diff"] = [d["diff"], d["low"], d["high"]]
                    continue
                d = paired_bootstrap(vals["no links"], b)  # with minus without
                dv = paired_bootstrap(vals["subject only"], b)  # with the other names minus the subject alone
                entry[metric]["diff"] = [d["diff"], d["low"], d["high"]]
                entry[metric]["diff_variants"] = [dv["diff"], dv["low"], dv["high"]]
            out["results"][f"{tier} {r:.3f}"] = entry
    return out


def _ci(d: list[float]) -> str:
    return f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]"


def _cell(metric: str, e: dict[str, Any], field: bool) -> str:
    """One metric's figures: links / title only (``field``), or links / subject only / no links."""
    if field:
        return f"{metric} {e['links']:.3f} / {e['title_only']:.3f} ({_ci(e['diff'])})"
    line = f"{metric} {e['links']:.3f} / {e.get('subject_only', float('nan')):.3f} / {e['no_links']:.3f}"
    line += f" (vs none {_ci(e['diff'])}"
    if e.get("diff_variants") is not None:
        line += f"; other names {_ci(e['diff_variants'])}"
    return line + ")"


def show(res: dict[str, Any]) -> None:
    field = res.get("titles") == "field"
    given = (
        "given with a title field: links (title + subject names) / title only"
        if field
        else "given without titles: links / subject only / no links"
    )
    print(f"HotpotQA dev, {res['questions']} questions from {res.get('offset', 0)}, {given} (paired, 95 % CI)")
    for key, entry in res["results"].items():
        print(f"  {key}: " + "; ".join(_cell(metric, e, field) for metric, e in entry.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hotpot", type=int, default=200)
    ap.add_argument("--offset", type=int, default=0, help="skip this many questions of the shuffle first")
    ap.add_argument("--titles", choices=tuple(ARMS), default="none", help="how the documents come (see above)")
    ap.add_argument("--out", default=str(RESULTS / "subject_links.json"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        show(json.loads(out.read_text()))
        return
    if not (data_dir() / "hotpotqa" / "dev.jsonl.gz").is_file():
        raise SystemExit(f"real data not found under {data_dir()}: this ablation needs ../shared/data")
    res = run(args.hotpot, args.offset, args.titles)
    out.write_text(json.dumps(res, indent=1))
    show(res)


if __name__ == "__main__":
    main()
