"""The lost-in-the-middle curve, read end to end: does reordering help the LLM that reads the context?

    OMP_NUM_THREADS=1 python benchmarks/litm.py --n-docs 20 --questions 50 --threads 1  # results/litm_n20.json, .png

Data: the NQ multi-document setting of Liu et al. (2023) rebuilt in ``../shared/data/nq_multidoc`` (see its README),
its ``test`` split only (``rag_opt.training.datasets.nq_split``: never trained on). For ``--n-docs`` N, the gold
passage is placed at each slot of the paper's grid (1, 5, 10, ... N, 1-based) among the first N-1 BM25 distractors;
the same ``--questions`` questions at every slot (the first of the split that have enough distractors).

Conditions (``--orders`` × ``--budgets``, or an explicit ``--conditions relevance@full,input@1/3,...``): the documents
the reader gets, in the order rag-opt gives them,

* orders: ``input`` (the retriever's, i.e. the paper's curve), ``lost_in_the_middle`` (end placement),
  ``relevance`` (best first, the rest by descending relevance), ``promote_best`` (best first, the rest in
  input order), ``promote_clear_best`` (the same, only when the first document's relevance is at most 1/20 of the
  best's), ``calibrated`` (placement by the positional
  profile of the reader, ``rag-opt calibrate --reader``, when one exists, else the proxy's, else end placement;
  the report says which placed the documents), ``attention_sort``;
* budgets: ``full`` (nothing dropped: ``ratio=1``) and fractions such as ``1/3`` (rag-opt's compression at that
  share of the o200k tokens, the library defaults otherwise);
* ``order+dropX@fraction`` (e.g. ``relevance+drop0.2@1/3``): the same with ``drop_below_best=X``, the documents
  whose relevance is below X times the best document's are dropped and the budget goes to the others.

Each condition is one ``ContextOptimizer().optimize(question, documents, ratio=..., ordering=...)`` call (the
library defaults: embedded SmolLM2 proxy, parallel encoding: the documents are read once per question and the other
conditions come from the encoding cache). Documents are rendered as in the paper, ``Document [i](Title: t) text``,
after the instruction "Write a high-quality answer for the given question using only the provided search results
(some of which might be irrelevant)." and before "Question: q"; the reader answers greedily (``--max-new-tokens``).

Reader: the embedded Qwen2.5-Coder-0.5B by default (``--reader embedded:smollm2-135m`` for the proxy itself, or a
Hugging Face id / local folder when a GPU is lent). Accuracy is the paper's ``best_subspan_em``: a SQuAD-normalised
gold answer is a substring of the normalised prediction.

Reported per slot and over slots: accuracy of every condition, and its paired difference to ``input`` at full
context with a percentile-bootstrap 95 % CI over questions (the same questions at each slot). Conditions are
interleaved per question in a rotating order, so machine noise hits all alike. Every answer is appended to a JSONL
cache next to the output (``litm.cache.jsonl``), keyed by the reader's signature, N, slot, question and condition,
with the SHA-256 of the context the reader was given; a context the reader already answered (same reader, N, slot
and question), under another condition or in an earlier run, reuses that answer, since the reader is greedy. A run
builds every condition's context anew and reuses an answer only for the very same context: a changed probe, profile
or rag-opt version re-asks exactly the conditions whose context is new (going back to an earlier probe asks
nothing again), and an interrupted run resumes where it
stopped (``--report-only`` re-prints and re-plots the saved results). A second process with ``--from-end`` walks the
questions from the other end on another core; the report covers the questions answered in every condition at every
slot (``questions_per_slot``, out of ``questions_asked``), with answers checked against this run's contexts
(``--cached-only`` trusts the cache).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from answers import Reader, paired_bootstrap
from common import data_dir

from rag_opt.models.loader import default_device, default_dtype
from rag_opt.training.datasets import NQExample, nq_split, read_nq_multidoc
from rag_opt.training.reader_calibration import best_subspan_em, reader_messages
from rag_opt.training.reader_calibration import render_search_results as render

logger = logging.getLogger("bench.litm")
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_READER = "embedded:qwen2.5-coder-0.5b"
ORDERS = (
    "input",
    "lost_in_the_middle",
    "relevance",
    "promote_best",
    "promote_clear_best",
    "calibrated",
    "attention_sort",
)
BASELINE = "input@full"
GRIDS = {10: (0, 4, 9), 20: (0, 4, 9, 14, 19), 30: (0, 4, 9, 14, 19, 24, 29)}


@dataclass(frozen=True)
class Condition:
    order: str
    ratio: float | None  # None: the full context
    drop: float | None = None  # ContextOptimizer(drop_below_best=...): documents far below the best are dropped

    @property
    def key(self) -> str:
        order = self.order if self.drop is None else f"{self.order}+drop{self.drop:g}"
        if self.ratio is None:
            return f"{order}@full"
        return f"{order}@{Fraction(self.ratio).limit_denominator(100)}"


def _condition(order: str, budget: str) -> Condition:
    try:
        ratio = None if budget == "full" else float(Fraction(budget))
    except (ValueError, ZeroDivisionError):
        raise SystemExit(f"budget {budget!r}: use 'full' or a fraction in (0, 1) such as 1/3") from None
    if ratio is not None and not 0 < ratio < 1:
        raise SystemExit(f"budget {budget!r}: use 'full' or a fraction in (0, 1) such as 1/3")
    order, _, drop_spec = order.partition("+")
    drop = None
    if drop_spec:
        try:
            drop = float(drop_spec.removeprefix("drop")) if drop_spec.startswith("drop") else None
        except ValueError:
            drop = None
        if drop is None or not 0 < drop <= 1 or ratio is None:
            raise SystemExit(
                f"{order}+{drop_spec}@{budget}: write order+dropX@fraction, X in (0, 1], e.g. "
                "relevance+drop0.2@1/3 (documents are dropped only under a budget)"
            )
    if order not in ORDERS:
        raise SystemExit(f"unknown order {order!r}: use {', '.join(ORDERS)}")
    return Condition(order, ratio, drop)


def parse_conditions(orders: str, budgets: str, explicit: str | None = None) -> list[Condition]:
    """``orders`` × ``budgets``, or the ``explicit`` list of ``order@budget`` (e.g. ``relevance@full,input@1/3``)."""
    out: list[Condition] = []
    if explicit:
        for spec in (x.strip() for x in explicit.split(",") if x.strip()):
            order, sep, budget = spec.partition("@")
            if not sep:
                raise SystemExit(f"condition {spec!r}: write order@budget, e.g. relevance@full or input@1/3")
            out.append(_condition(order.strip(), budget.strip()))
    else:
        for budget in (b.strip() for b in budgets.split(",") if b.strip()):
            out.extend(_condition(o.strip(), budget) for o in orders.split(",") if o.strip())
    keys = [c.key for c in out]
    if len(set(keys)) != len(keys):
        raise SystemExit(f"a condition is listed twice: {', '.join(keys)}")
    if BASELINE not in keys:
        raise SystemExit(f"the conditions must include the baseline {BASELINE} (orders 'input', budget 'full')")
    return out


class LitmReader(Reader):
    """:class:`answers.Reader` with the paper's prompt: the instruction, the numbered documents, the question."""

    @staticmethod
    def messages(question: str, context: str) -> list[dict[str, str]]:
        return reader_messages(question, context)


def contexts(
    opt: Callable[[float | None], Any], ex: NQExample, n_docs: int, slot: int, conds: list[Condition]
) -> dict[str, dict[str, Any]]:
    """Each condition's rendered context and its SHA-256, where the gold passage landed (0-based; None: dropped),
    how many documents were kept, the context's o200k tokens, and the profile that placed the documents (calibrated
    ordering)."""
    docs = ex.documents(n_docs, slot)
    inputs = [{"id": str(i), "title": d["title"], "text": d["text"]} for i, d in enumerate(docs)]
    out = {}
    for c in conds:
        result = opt(c.drop).optimize(ex.question, inputs, ratio=1.0 if c.ratio is None else c.ratio, ordering=c.order)
        kept = [(d.title or "", d.text) for d in result.documents]
        ids = [d.id for d in result.documents]
        context = render(kept)
        out[c.key] = {
            "context": context,
            "context_sha": hashlib.sha256(context.encode()).hexdigest(),
            "gold_at": ids.index(str(slot)) if str(slot) in ids else None,
            "n_kept": len(ids),
            "tokens": result.tokens_after,
            "placement_profile": result.placement_profile,
        }
    return out


def _cache_key(signature: str, n_docs: int, slot: int, index: int, cond: str) -> str:
    return f"{signature}|n{n_docs}|s{slot}|q{index}|{cond}"


def _context_key(key: str, sha: str) -> tuple[str, str]:
    """(reader, N, slot and question; the context's SHA-256) of a cache row's key: what makes two answers the same."""
    return key.rsplit("|", 1)[0], sha


def _questions(args: argparse.Namespace) -> list[NQExample]:
    path = data_dir() / "nq_multidoc" / "public.jsonl.gz"
    if not path.is_file():
        raise SystemExit(f"NQ multi-document data not found at {path} (see ../shared/data/README.md)")
    records = nq_split(read_nq_multidoc(path, min_distractors=29), "test")
    return records[: args.questions]


def _grid(args: argparse.Namespace) -> list[int]:
    grid = [s for s in GRIDS[args.n_docs] if not args.slots or s + 1 in args.slots]
    if not grid:
        raise SystemExit(f"no slot of the grid {[s + 1 for s in GRIDS[args.n_docs]]} was asked for")
    return grid


def _load_cache(path: Path) -> dict[str, dict[str, Any]]:
    cache: dict[str, dict[str, Any]] = {}
    _read_new(path, 0, cache, {})
    return cache


def _read_new(
    path: Path, offset: int, cache: dict[str, dict[str, Any]], answered: dict[tuple[str, str], dict[str, Any]]
) -> int:
    """Add the cache file's complete lines from byte ``offset`` on to ``cache`` (a later answer for a key replaces
    an earlier one) and to ``answered`` (every answer by its context: an earlier probe's answer is still the answer
    to its context when a run builds that context again); returns the offset after the last complete line. Another
    process may be appending."""
    if not path.is_file():
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a line still being written is read next time
    for line in data[:end].decode().splitlines():
        if line.strip():
            row = json.loads(line)
            cache[row["key"]] = row
            if row.get("context_sha"):
                answered[_context_key(row["key"], row["context_sha"])] = row
    return offset + end


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.pipeline import ContextOptimizer

    questions, grid = _questions(args), _grid(args)
    conds = parse_conditions(args.orders, args.budgets, args.conditions)
    device = args.device or default_device()
    reader = LitmReader(args.reader, device, args.dtype or default_dtype(device), args.max_new_tokens)
    # the reader is the target: calibrated ordering places by its profile when `rag-opt calibrate --reader` made one
    encodings = EncodingCache()  # one for every optimizer: each document is read once per question
    optimizers: dict[float | None, ContextOptimizer] = {}

    def opt(drop: float | None) -> ContextOptimizer:
        if drop not in optimizers:
            optimizers[drop] = ContextOptimizer(
                threads=args.threads or "auto", reader=args.reader, cache=encodings, drop_below_best=drop
            )
        return optimizers[drop]

    cache_path = Path(args.cache) if args.cache else Path(args.out).with_suffix(".cache.jsonl")
    cache: dict[str, dict[str, Any]] = {}
    answered: dict[tuple[str, str], dict[str, Any]] = {}  # the greedy reader answers a context once
    offset = _read_new(cache_path, 0, cache, answered)
    checked: set[str] = set()  # keys whose cached answer was given for the context built in this run
    step = 0
    # slot-major within each question: every question is answered at every slot before the next one starts, so a
    # run stopped early leaves whole questions (the paired comparison needs the same questions at each slot)
    walk = [] if args.cached_only else questions[::-1] if args.from_end else questions
    with open(cache_path, "a") as sink, tqdm(total=len(walk) * len(grid), desc=f"litm N={args.n_docs}") as bar:
        for ex in walk:
            for slot in grid:
                keys = {c.key: _cache_key(reader.signature, args.n_docs, slot, ex.index, c.key) for c in conds}
                offset = _read_new(cache_path, offset, cache, answered)  # the other end's answers
                built = contexts(opt, ex, args.n_docs, slot, conds)
                missing = []
                for c in conds:
                    row = cache.get(keys[c.key])
                    if row is not None and row.get("context_sha") == built[c.key]["context_sha"]:
                        checked.add(keys[c.key])
                    else:  # never asked, or asked with another context (e.g. before a probe changed)
                        missing.append(c)
                if missing:
                    rot = step % len(missing)
                    for c in missing[rot:] + missing[:rot]:  # a rotating order: noise hits all conditions alike
                        sha = built[c.key]["context_sha"]
                        same = answered.get(_context_key(keys[c.key], sha))  # this very context, answered before
                        t0 = time.perf_counter()
                        raw = same["answer"] if same else reader.answer(ex.question, built[c.key]["context"])
                        row = {
                            "key": keys[c.key],
                            "answer": raw,
                            "correct": best_subspan_em(raw, ex.answers),
                            **{
                                k: built[c.key][k]
                                for k in ("context_sha", "gold_at", "n_kept", "tokens", "placement_profile")
                            },
                            "reader_s": same["reader_s"] if same else round(time.perf_counter() - t0, 3),
                            **({"same_context_as": same["key"]} if same else {}),
                        }
                        cache[row["key"]] = row
                        answered[_context_key(row["key"], sha)] = row
                        checked.add(row["key"])
                        sink.write(json.dumps(row) + "\n")
                        sink.flush()
                        logger.debug("q%d slot %d %s: %r -> %s", ex.index, slot + 1, c.key, raw, row["correct"])
                step += 1
                bar.update(1)
    if args.cached_only:
        logger.warning("--cached-only: the answers are not checked against the contexts this rag-opt would build")
        return summarise(args, conds, grid, questions, _load_cache(cache_path), reader.signature)
    # only answers checked against this run's contexts count: a process walking from the other end answers its
    # questions first, and this one then checks them when it gets there (building the contexts, asking nothing)
    return summarise(args, conds, grid, questions, {k: cache[k] for k in checked}, reader.signature)


def summarise(
    args: argparse.Namespace,
    conds: list[Condition],
    grid: list[int],
    questions: list[NQExample],
    cache: dict[str, dict[str, Any]],
    signature: str,
) -> dict[str, Any]:
    """Accuracy per slot and over slots of every condition, and its paired difference to :data:`BASELINE`, over
    the questions answered in every condition at every slot (a run stopped early, or two processes walking from
    both ends, leave some unanswered: they are left out, and counted)."""
    complete = [
        ex
        for ex in questions
        if all(_cache_key(signature, args.n_docs, slot, ex.index, c.key) in cache for c in conds for slot in grid)
    ]
    if not complete:
        raise SystemExit("no question has been answered in every condition at every slot yet")

    def rows(cond: str, slot: int) -> list[dict[str, Any]]:
        return [cache[_cache_key(signature, args.n_docs, slot, ex.index, cond)] for ex in complete]

    res: dict[str, Any] = {
        "n_docs": args.n_docs,
        "questions_per_slot": len(complete),
        "questions_asked": len(questions),
        "questions": [ex.index for ex in complete],
        "reader": args.reader,
        "reader_signature": signature,
        "slots": [s + 1 for s in grid],
        "baseline": BASELINE,
        "conditions": {},
    }
    for c in conds:
        per_slot, diffs, every, every_base, placed, won_lost = [], [], [], [], [], []
        for slot in grid:
            got = rows(c.key, slot)
            a = [float(r["correct"]) for r in got]
            b = [float(r["correct"]) for r in rows(BASELINE, slot)]
            per_slot.append(float(np.mean(a)))
            diffs.append(paired_bootstrap(a, b))
            # the discordant pairs behind the CI: questions only this condition answered, and only the baseline
            won_lost.append(
                [sum(x > y for x, y in zip(a, b, strict=True)), sum(x < y for x, y in zip(a, b, strict=True))]
            )
            every += a
            every_base += b
            placed += got
        res["conditions"][c.key] = {
            "accuracy_per_slot": per_slot,
            "accuracy_mean": float(np.mean(per_slot)),
            "best_minus_worst": float(max(per_slot) - min(per_slot)),
            "diff_per_slot": [dict(zip(("mean", "lo", "hi"), d, strict=True)) for d in diffs],
            "diff_mean": dict(zip(("mean", "lo", "hi"), paired_bootstrap(every, every_base), strict=True)),
            "won_lost_per_slot": won_lost,
            "gold_kept": float(np.mean([r["gold_at"] is not None for r in placed])),
            "gold_first": float(np.mean([r["gold_at"] == 0 for r in placed])),
            "gold_last": float(np.mean([r["gold_at"] is not None and r["gold_at"] == r["n_kept"] - 1 for r in placed])),
            "mean_tokens": float(np.mean([r["tokens"] for r in placed])),
            "placement_profiles": sorted({str(r.get("placement_profile")) for r in placed}),
        }
    return res


def show(res: dict[str, Any]) -> None:
    slots = res["slots"]
    print(
        f"lost in the middle, N={res['n_docs']}, {res['questions_per_slot']} questions per slot, reader {res['reader']}"
    )
    print(f"accuracy (best_subspan_em) per gold slot; diff: paired vs {res['baseline']}, 95 % CI")
    head = f"{'condition':28s}" + "".join(f"{'slot ' + str(s):>8s}" for s in slots)
    print(head + f"{'mean':>8s}  {'diff mean [CI]':>24s}  {'worst diff lo':>13s}  {'tokens':>7s}  gold first/last")
    for key, c in res["conditions"].items():
        d = c["diff_mean"]
        worst_lo = min(x["lo"] for x in c["diff_per_slot"])
        print(
            f"{key:28s}"
            + "".join(f"{a:8.2f}" for a in c["accuracy_per_slot"])
            + f"{c['accuracy_mean']:8.3f}  {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]  {worst_lo:+13.3f}"
            + f"  {c['mean_tokens']:7.0f}  {c['gold_first']:.2f}/{c['gold_last']:.2f}"
        )
    paired = [key for key, c in res["conditions"].items() if key != res["baseline"] and "won_lost_per_slot" in c]
    if paired:
        print(f"questions answered only by the condition / only by {res['baseline']}, per slot:")
    for key, c in res["conditions"].items():
        if key in paired:
            print(f"{key:28s}" + "".join(f"{f'+{w}/-{lo}':>8s}" for w, lo in c["won_lost_per_slot"]))
    for key, c in res["conditions"].items():
        placed_by = _profiles_summary([p for p in c.get("placement_profiles", []) if p != "None"])
        if placed_by:
            print(f"{key}: placed by {placed_by}")


def _profiles_summary(profiles: list[str]) -> str:
    """The profiles that placed a condition's contexts, one line: a profile resampled to several document counts
    (compressed contexts that dropped documents) is named once, with the range of counts."""
    counts: dict[str, list[int]] = {}
    for p in profiles:
        base, sep, n = p.rpartition(", resampled to ")
        if sep and n.isdigit():
            counts.setdefault(base, []).append(int(n))
        else:
            counts.setdefault(p, [])
    parts = []
    for base, ns in counts.items():
        if not ns:
            parts.append(base)
        else:
            lo, hi = min(ns), max(ns)
            parts.append(f"{base}, resampled to {lo}" + (f"-{hi} documents" if hi > lo else " documents"))
    return "; ".join(parts)


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({k.split("@")[1] for k in res["conditions"]}, key=lambda b: (b != "full", b))
    orders = list(dict.fromkeys(k.split("@")[0] for k in res["conditions"]))
    colour = {o: f"C{i}" for i, o in enumerate(orders)}  # one colour per order in every panel
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 4), sharey=True, squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        for key, c in res["conditions"].items():
            order, b = key.split("@")
            if b != budget:
                continue
            style = "-" if order != "input" else "--"
            ax.plot(res["slots"], c["accuracy_per_slot"], style, marker="o", label=order, color=colour[order])
        base = res["conditions"][res["baseline"]]["accuracy_per_slot"]
        if budget != "full":
            ax.plot(res["slots"], base, ":", color="grey", label="input, full context")
        ax.set_title(f"{'full context' if budget == 'full' else 'compressed to ' + budget} (N={res['n_docs']})")
        ax.set_xlabel("position of the gold document (1-based)")
        ax.set_xticks(res["slots"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"accuracy ({res['questions_per_slot']} questions per slot)")
    fig.suptitle(f"Lost in the middle: reader {res['reader']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _slots(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-docs", type=int, default=20, choices=sorted(GRIDS))
    ap.add_argument("--questions", type=int, default=50, help="questions per slot (NQ test split, in file order)")
    ap.add_argument("--slots", type=_slots, default=None, help="1-based gold slots of the grid, e.g. 1,10,20")
    ap.add_argument("--orders", default=",".join(ORDERS), help=f"comma-separated (default: {','.join(ORDERS)})")
    ap.add_argument("--budgets", default="full,1/3", help="comma-separated: full and/or fractions (default full,1/3)")
    ap.add_argument(
        "--conditions",
        default=None,
        help="an explicit list of order@budget instead of --orders x --budgets, e.g. "
        "input@full,relevance@full,relevance@1/3 (must include input@full)",
    )
    ap.add_argument("--reader", default=DEFAULT_READER, help="reader LM: embedded:<name>, HF id or local folder")
    ap.add_argument("--device", default=None, help="reader device (default cpu)")
    ap.add_argument("--dtype", default=None, help="reader precision (default: bf16 where native, else float32)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: rag-opt's 'auto')")
    ap.add_argument("--out", default=None, help="results JSON (default results/litm_n<N>.json)")
    ap.add_argument(
        "--cache",
        default=None,
        help="answer cache JSONL (default: next to --out, <out>.cache.jsonl): several reports of one set of answers",
    )
    ap.add_argument("--report-only", action="store_true", help="re-print and re-plot the saved results")
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="answer nothing new: write the report from what the answer cache holds (e.g. after stopping a run)",
    )
    ap.add_argument(
        "--from-end",
        action="store_true",
        help="walk the questions from the last one (a second process on another core: both append to the same "
        "answer cache; the report covers the questions answered in every condition)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log every answer")
    args = ap.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out or RESULTS / f"litm_n{args.n_docs}.json")
    res = json.loads(out.read_text()) if args.report_only else run(argparse.Namespace(**{**vars(args), "out": out}))
    if not args.report_only:
        out.write_text(json.dumps(res, indent=1))
    show(res)
    plot(res, out.with_suffix(".png"))
    print(f"curves: {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
