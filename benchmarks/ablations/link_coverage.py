"""How many of the links a title gives the second stage an untitled document still gets (offline: no model).

    python benchmarks/ablations/link_coverage.py --split train --questions 3000  # results/link_coverage.json, ~50 s

For the first ``--questions`` HotpotQA questions of the seeded shuffle, the links ``named_by_other`` reads
(:func:`rag_opt.compressors.context_features.document_links`: a candidate sentence of document ``e`` names document
``d``) are counted with the paragraphs given four ways:

* ``title field``: each paragraph has its title (the reference: the title alone);
* ``title + subject names``: and, where salient, the subject its text opens with when that is not its title, and
  that subject's other names (``rag_opt.text.name_variants.subject_names``; what the library does with a title);
* ``subject alone``: no title; linked by the subject its text opens with (``rag_opt.text.titles.leading_subject``);
* ``subject + other names``: and the other names the rules of ``rag_opt.text.name_variants`` give it;
* ``+ short forms``: and the short forms of a person's given name ("Richard" → "Rick");
* ``+ opening names``: and, for a paragraph that opens with no subject, the first proper name of its text where
  at most one other paragraph names it (``rag_opt.text.name_variants.opening_name``; what the library does).

``supporting`` counts the links between the question's two supporting paragraphs (the bridge the second hop
needs), ``all`` every link (most join paragraphs that are not both supporting: the noise a rule adds). Use the
train split to shape a rule, so that dev stays unseen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir  # noqa: E402

from rag_opt.compressors.context_features import document_links  # noqa: E402
from rag_opt.text.name_variants import name_variants  # noqa: E402
from rag_opt.text.units import UnitTable  # noqa: E402
from rag_opt.training.datasets import HotpotExample, read_hotpotqa  # noqa: E402
from rag_opt.training.units import hotpot_table  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
ARMS = (
    "title field",
    "title + subject names",
    "subject alone",
    "subject + other names",
    "+ short forms",
    "+ opening names",
)


def arm_table(ex: HotpotExample, arm: str) -> UnitTable:
    if arm in ("title field", "title + subject names"):
        table = hotpot_table(ex, "field")  # the library's links: the title and the subject names
        return table if arm != "title field" else dataclasses.replace(table, link_spans=tuple(() for _ in ex.titles))
    table = hotpot_table(ex, "none")  # the library's links: subject, other names, short forms, opening names
    if arm == "+ opening names":
        return table
    table = dataclasses.replace(table, link_spans=tuple(() for _ in table.link_spans))
    if arm == "subject alone":
        return dataclasses.replace(table, link_variants=tuple(() for _ in table.link_variants))
    if arm == "subject + other names":
        variants = tuple(
            name_variants(s, ex.paragraph_text(p), short_forms=False) if s else ()
            for p, s in enumerate(table.link_names)
        )
        return dataclasses.replace(table, link_variants=variants)
    return table


def run(split: str, n: int) -> dict[str, Any]:
    from tqdm.auto import tqdm

    questions = read_hotpotqa(data_dir() / "hotpotqa" / f"{split}.jsonl.gz", seed=0, limit=n)
    counts = {arm: {"supporting": 0, "all": 0} for arm in ARMS}
    for ex in tqdm(questions, desc=f"links ({split})", mininterval=5):
        sup = {p for p, _ in ex.supporting}
        for arm in ARMS:
            links = document_links(arm_table(ex, arm))
            counts[arm]["supporting"] += sum(1 for d, e in links if d in sup and e in sup)
            counts[arm]["all"] += len(links)
    return {"split": split, "questions": len(questions), "counts": counts}


def show(res: dict[str, Any]) -> None:
    ref = res["counts"]["title field"]
    print(f"HotpotQA {res['split']}, {res['questions']} questions: links between documents")
    print(f"{'paragraphs given as':<26} {'supporting':>10} {'share':>6} {'all':>7}")
    for arm, c in res["counts"].items():
        share = c["supporting"] / ref["supporting"] if ref["supporting"] else float("nan")
        print(f"{arm:<26} {c['supporting']:>10} {share:>6.1%} {c['all']:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="train", choices=("train", "dev"))
    ap.add_argument("--questions", type=int, default=3000)
    ap.add_argument("--out", default=str(RESULTS / "link_coverage.json"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    path = Path(args.out)
    if not (data_dir() / "hotpotqa" / f"{args.split}.jsonl.gz").is_file():
        raise SystemExit(f"real data not found under {data_dir()}: this ablation needs ../shared/data")
    res = json.loads(path.read_text()) if args.report_only else run(args.split, args.questions)
    if not args.report_only:
        path.write_text(json.dumps(res, indent=1))
    show(res)


if __name__ == "__main__":
    main()
