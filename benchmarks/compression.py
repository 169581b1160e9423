"""Compression quality and latency on real data: rag-opt's probe vs raw attention, BM25, embeddings, lead, random
(and LongLLMLingua on a subset, see ``--llmlingua``).

Every sentence-selection method runs through the same library pipeline (``ContextOptimizer(scorer=...)``):
same segmentation, same target-token budget (o200k_base), same selection rule, titles counted in the budget.

    python benchmarks/compression.py --hotpot 200 --squad 200          # → benchmarks/results/compression.{json,png}

Metrics (HotpotQA dev): supporting-fact recall (share of supporting sentences fully kept), all-facts-kept (every
supporting sentence of the question kept), answer retention (the answer string in the kept text; yes/no answers
excluded), achieved ratio (mean and max; above the target only for a context so short that no unit fits the
budget: its best unit is then kept whole, with a warning, so that the context is not emptied; e.g. dev question 775
of the shuffle, two paragraphs of 92 tokens in all). SQuAD 2.0 dev (answerable questions, the question's paragraph
among 4 other paragraphs of its article): answer-sentence kept and answer retention.
Latency: median optimize time per question (model loaded, HotpotQA, first ratio) and its ratio to a bare forward
pass of the proxy over the same prompt, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from common import data_dir, paired_bootstrap

from rag_opt.compressors.base import Scores
from rag_opt.compressors.lexical_scorer import LexicalScorer
from rag_opt.pipeline import ContextOptimizer
from rag_opt.text.units import UnitTable
from rag_opt.training.datasets import contains_answer, iter_squad, read_hotpotqa
from rag_opt.types import OptimizeResult

logger = logging.getLogger("bench.compression")
RESULTS = Path(__file__).resolve().parent / "results"
GAP_METRICS = ("sf_recall", "all_facts_kept", "answer_retention")


class MemoScorer:
    """Scores each context once; later ratios reuse the scores (selection is deterministic given scores)."""

    def __init__(self, inner: Any, transform: Callable[[Scores], Scores] | None = None) -> None:
        self.inner = inner
        self.transform = transform
        self.cache: dict[Any, Scores] = {}
        self.last_ms = 0.0

    def score(self, question: str, units: UnitTable) -> Scores:
        key = (question, units.texts)
        if key not in self.cache:
            t = time.perf_counter()
            self.cache[key] = self.inner.score(question, units)
            self.last_ms = (time.perf_counter() - t) * 1e3
        s = self.cache[key]
        return self.transform(s) if self.transform else s


def raw_attention(s: Scores) -> Scores:
    assert s.attention is not None
    unit = s.attention.unit[:, 1].mean(axis=(1, 2)).astype(np.float64)
    return Scores(unit=unit, doc=s.doc, method="raw-attention", model=s.model, attention=s.attention)


def _covered(spans: list[tuple[int, int]], a: int, b: int) -> bool:
    return any(s <= a and b <= e for s, e in spans)


TITLE_REGIMES = ("field", "none", "text")


def hotpot_documents(ex: Any, titles: str) -> tuple[list[dict[str, str]], list[int]]:
    """The question's paragraphs as documents, the title given as users give it (``titles``: ``field``: a title
    field; ``none``: no title anywhere; ``text``: the title as the text's first line), and where each paragraph
    starts in its document's text. The id is the title in every regime (rag-opt never reads an id as a title)."""
    if titles == "field":
        return [{"id": t, "title": t, "text": ex.paragraph_text(p)} for p, t in enumerate(ex.titles)], [0] * len(
            ex.titles
        )
    if titles == "none":
        return [{"id": t, "text": ex.paragraph_text(p)} for p, t in enumerate(ex.titles)], [0] * len(ex.titles)
    if titles == "text":
        docs = [{"id": t, "text": f"{t}\n{ex.paragraph_text(p).lstrip()}"} for p, t in enumerate(ex.titles)]
        shifts = [
            len(t) + 1 - (len(ex.paragraph_text(p)) - len(ex.paragraph_text(p).lstrip()))
            for p, t in enumerate(ex.titles)
        ]
        return docs, shifts
    raise SystemExit(f"unknown title regime {titles!r}: use {', '.join(TITLE_REGIMES)}")


def hotpot_metrics(ex: Any, result: OptimizeResult, shifts: list[int] | None = None) -> dict[str, float | None]:
    """Supporting-fact recall, all facts kept, answer kept and the achieved ratio; ``shifts``: where each paragraph
    starts in its document's text (its title line before it)."""
    by_id = {d.id: d for d in result.documents}
    hits = []
    for p, s in sorted(ex.supporting):
        text = ex.paragraph_text(p)
        shift = shifts[p] if shifts else 0
        a = sum(len(x) for x in ex.sentences[p][:s])
        b = a + len(ex.sentences[p][s])
        sent = text[a:b]
        a2 = a + (len(sent) - len(sent.lstrip()))
        b2 = b - (len(sent) - len(sent.rstrip()))
        doc = by_id.get(ex.titles[p])
        hits.append(doc is not None and (a2 >= b2 or _covered(doc.kept_spans, a2 + shift, b2 + shift)))
    return {
        "sf_recall": float(np.mean(hits)) if hits else None,
        "all_facts_kept": float(all(hits)) if hits else None,
        "answer_retention": None if ex.yes_no else float(contains_answer(result.context(), ex.answer)),
        "ratio": result.ratio,
    }


def squad_examples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    path = data_dir() / "squad2" / "dev.json.gz"
    by_title: dict[str, list[str]] = {}
    qs = []
    for title, ctx, qa in iter_squad(path):
        paras = by_title.setdefault(title, [])
        if ctx not in paras:
            paras.append(ctx)
        if not qa["is_impossible"]:
            qs.append((title, ctx, qa))
    rng = random.Random(seed)
    rng.shuffle(qs)
    out = []
    for title, ctx, qa in qs[:n]:
        others = [p for p in by_title[title] if p != ctx]
        docs = rng.sample(others, min(4, len(others))) + [ctx]
        rng.shuffle(docs)
        ans = qa["answers"][0]
        out.append(
            {
                "question": qa["question"],
                "docs": [{"id": str(i), "text": t, "title": title} for i, t in enumerate(docs)],
                "gold": str(docs.index(ctx)),
                "answer": ans["text"],
                "answer_start": ans["answer_start"],
                "answers": [a["text"] for a in qa["answers"]],
            }
        )
    return out


def squad_metrics(ex: dict[str, Any], result: OptimizeResult) -> dict[str, float | None]:
    doc = next((d for d in result.documents if d.id == ex["gold"]), None)
    a, b = ex["answer_start"], ex["answer_start"] + len(ex["answer"])
    sentence_kept = doc is not None and any(
        u.kept and u.start <= a < u.end for u in doc.units
    )  # the unit holding the answer's start is kept
    full = doc is not None and _covered(doc.kept_spans, a, b)
    return {
        "answer_sentence_kept": float(sentence_kept and full),
        "answer_retention": float(any(contains_answer(result.context(), x) for x in ex["answers"])),
        "ratio": result.ratio,
    }


def bare_forward_ms(proxy: Any, units: UnitTable, question: str) -> float:
    import torch

    from rag_opt.models.prompt import render_prompt

    ids = proxy.tokenizer(render_prompt(units.by_document(), question).text)["input_ids"]
    with torch.inference_mode():
        t = time.perf_counter()
        proxy.model.model(input_ids=torch.tensor([ids]), use_cache=False)
        return (time.perf_counter() - t) * 1e3


class ContextSpy:
    """Wraps a scorer to remember the last context it saw (to time a bare forward on exactly that prompt)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last: tuple[str, UnitTable] | None = None

    def score(self, question: str, units: UnitTable) -> Scores:
        self.last = (question, units)
        return self.inner.score(question, units)


def summarize(rows: list[dict[str, float | None]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in rows[0] if rows else []:
        vals = [r[key] for r in rows if r[key] is not None]
        if vals:
            out[key] = float(np.mean(vals))
    if rows:
        out["max_ratio"] = float(max(r["ratio"] or 0.0 for r in rows))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rag_opt.compressors import BM25Scorer, EmbeddingScorer, LeadScorer, RandomScorer, SentinelCompressor

    ratios = [float(Fraction(r)) for r in args.ratios.split(",")]
    hotpot = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + args.hotpot)
    hotpot = hotpot[args.offset :]
    squad = squad_examples(args.squad) if args.squad else []
    sentinel = SentinelCompressor.from_model(
        args.model, probe=args.probe, doc_probe=args.doc_probe, encoding=args.encoding, dtype=args.dtype
    )
    probe_memo = MemoScorer(ContextSpy(sentinel))
    methods: dict[str, MemoScorer] = {
        "rag-opt probe" if sentinel.probe is not None else "rag-opt (no probe: raw attention)": probe_memo,
        "raw attention (mean over heads)": MemoScorer(probe_memo, raw_attention),
        "rag-opt lexical tier (no model)": MemoScorer(LexicalScorer()),
        "BM25 (title. sentence)": MemoScorer(BM25Scorer()),
        "embeddings (MiniLM)": MemoScorer(EmbeddingScorer()),
        "lead": MemoScorer(LeadScorer()),
        "random": MemoScorer(RandomScorer(seed=0)),
    }
    results: dict[str, Any] = {
        "ratios": ratios,
        "hotpot_questions": len(hotpot),
        "hotpot_offset": args.offset,
        "squad_questions": len(squad),
        "encoding": args.encoding,
        "probe": str(args.probe),
    }
    if args.only_probe:  # the probe, the lexical tier and BM25 only (comparing probes or encodings)
        methods = {k: v for k, v in methods.items() if k.startswith(("rag-opt", "BM25"))}
    table: dict[str, dict[str, Any]] = {}
    per_question: dict[tuple[str, str, str], list[dict[str, float | None]]] = {}  # (method, titles, ratio) → rows
    latency: dict[str, list[float]] = {"rag-opt": [], "bare forward": []}
    from tqdm.auto import tqdm

    regimes = [t.strip() for t in args.titles.split(",") if t.strip()]
    results["titles"] = regimes
    for (name, scorer), titles in ((m, t) for t in regimes for m in methods.items()):
        opt = ContextOptimizer(scorer=scorer)
        per_ratio: dict[str, Any] = {}
        for r in ratios:
            rows = []
            for ex in tqdm(hotpot, desc=f"{name} [{titles}] hotpot r={r:.2f}", mininterval=10):
                docs, shifts = hotpot_documents(ex, titles)
                t0 = time.perf_counter()
                res = opt.optimize(ex.question, docs, ratio=r)
                total_ms = (time.perf_counter() - t0) * 1e3
                if scorer is probe_memo and r == ratios[0] and titles == regimes[0] and not args.no_bare_forward:
                    latency["rag-opt"].append(total_ms)
                    spy = scorer.inner
                    assert spy.last is not None
                    latency["bare forward"].append(bare_forward_ms(sentinel.proxy, spy.last[1], spy.last[0]))
                rows.append(hotpot_metrics(ex, res, shifts))
            srows = []
            for ex in tqdm(squad, desc=f"{name} squad r={r:.2f}", mininterval=10):
                res = opt.optimize(ex["question"], ex["docs"], ratio=r)
                srows.append(squad_metrics(ex, res))
            per_ratio[f"{r:.3f}"] = {"hotpot": summarize(rows), "squad": summarize(srows) if srows else {}}
            per_question[(name, titles, f"{r:.3f}")] = rows
        table[name if titles == "field" else f"{name} [titles: {titles}]"] = per_ratio
    results["methods"] = table
    results["title_gaps"] = title_gaps(per_question)
    med_opt = statistics.median(latency["rag-opt"]) if latency["rag-opt"] else float("nan")
    med_fwd = statistics.median(latency["bare forward"]) if latency["bare forward"] else float("nan")
    per_q = [a / b for a, b in zip(latency["rag-opt"], latency["bare forward"], strict=True) if b > 0]
    results["latency"] = {
        "median_optimize_ms": med_opt,
        "median_bare_forward_ms": med_fwd,
        "ratio_of_medians": med_opt / med_fwd if latency["bare forward"] else float("nan"),
        "median_per_question_ratio": statistics.median(per_q) if per_q else float("nan"),
        "questions": len(latency["rag-opt"]),
    }
    return results


def title_gaps(per_question: dict[tuple[str, str, str], list[dict[str, float | None]]]) -> dict[str, Any]:
    """Each other title regime against the title field, paired per question (the same questions, method and
    ratio): the mean difference (regime minus field) with its 95 % bootstrap interval, per HotpotQA metric."""
    gaps: dict[str, Any] = {}
    for (name, titles, r), rows in per_question.items():
        base = per_question.get((name, "field", r))
        if titles == "field" or base is None:
            continue
        gaps.setdefault(f"{name} [titles: {titles}] - field", {})[r] = {
            m: paired_bootstrap([x[m] for x in base], [x[m] for x in rows]) for m in GAP_METRICS
        }
    return gaps


def attach_llmlingua(results: dict[str, Any]) -> None:
    """Add LongLLMLingua's figures from benchmarks/llmlingua_baseline.py (run separately: ~25–150 s per question
    here, so on a prefix of the same questions) when its results file exists."""
    path = RESULTS / "llmlingua.json"
    if path.is_file():
        results["llmlingua"] = json.loads(path.read_text())


def print_table(results: dict[str, Any]) -> None:
    print(f"HotpotQA dev: {results['hotpot_questions']} questions; SQuAD 2.0 dev: {results['squad_questions']}")
    head = f"{'method':<36} {'target':>6} {'sf_rec':>7} {'all_kept':>8} {'answer':>7} {'ratio':>6} {'max':>6}"
    head += f" {'sq_sent':>7} {'sq_ans':>7}"
    print(head)
    for name, per_ratio in results["methods"].items():
        for r, m in per_ratio.items():
            h, s = m["hotpot"], m["squad"]
            print(
                f"{name:<36} {float(r):>6.3f} {h.get('sf_recall', float('nan')):>7.3f} "
                f"{h.get('all_facts_kept', float('nan')):>8.3f} {h.get('answer_retention', float('nan')):>7.3f} "
                f"{h.get('ratio', float('nan')):>6.3f} {h.get('max_ratio', float('nan')):>6.3f} "
                f"{s.get('answer_sentence_kept', float('nan')):>7.3f} {s.get('answer_retention', float('nan')):>7.3f}"
            )
    gaps = results.get("title_gaps") or {}
    if gaps:
        print("paired against the title field (mean difference [95 % bootstrap interval]):")
        for name, per_ratio in gaps.items():
            for r, m in per_ratio.items():
                cells = "  ".join(
                    f"{k} {v['diff']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}]" for k, v in m.items() if v["n"]
                )
                print(f"  {name:<60} {float(r):>6.3f}  {cells}")
    lat = results["latency"]
    print(
        f"latency (HotpotQA, {lat['questions']} questions): rag-opt median {lat['median_optimize_ms']:.0f} ms, "
        f"bare proxy forward median {lat['median_bare_forward_ms']:.0f} ms → {lat['ratio_of_medians']:.2f}× "
        f"(per-question median {lat['median_per_question_ratio']:.2f}×)"
    )
    if "llmlingua" in results:
        ll = results["llmlingua"]
        for r, m in ll.get("by_ratio", {}).items():
            print(
                f"{'LongLLMLingua (SmolLM2, separate run)':<36} {float(r):>6.3f} "
                f"{m.get('sf_recall', float('nan')):>7.3f} "
                f"{m.get('all_facts_kept', float('nan')):>8.3f} {m.get('answer_retention', float('nan')):>7.3f} "
                f"{m.get('ratio', float('nan')):>6.3f} {m.get('max_ratio', float('nan')):>6.3f}     n/a     n/a"
                f"   ({ll.get('questions')} questions; supporting facts counted only if kept verbatim; "
                f"median {m.get('median_latency_s', float('nan')):.0f} s/question)"
            )


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, per_ratio in results["methods"].items():
        xs = [float(r) for r in per_ratio]
        ys = [per_ratio[r]["hotpot"].get("sf_recall", float("nan")) for r in per_ratio]
        ax.plot(xs, ys, marker="o", label=name)
    if "llmlingua" in results:
        for r, m in results["llmlingua"].get("by_ratio", {}).items():
            ax.scatter([float(r)], [m.get("sf_recall", float("nan"))], marker="x", color="k", label="LongLLMLingua")
    ax.set_xlabel("target ratio (share of o200k tokens kept)")
    ax.set_ylabel("supporting-fact recall (HotpotQA dev)")
    ax.set_title(f"Sentence compression, {results['hotpot_questions']} HotpotQA dev questions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hotpot", type=int, default=200, help="HotpotQA dev questions (seeded shuffle)")
    ap.add_argument("--offset", type=int, default=0, help="skip this many HotpotQA questions of the shuffle first")
    ap.add_argument("--squad", type=int, default=200, help="SQuAD 2.0 dev answerable questions")
    ap.add_argument("--ratios", default="1/2,1/3,1/5")
    ap.add_argument("--model", default=None)
    ap.add_argument("--probe", default="auto")
    ap.add_argument("--doc-probe", default="auto")
    ap.add_argument("--encoding", default="joint", choices=("joint", "parallel"))
    ap.add_argument("--dtype", default=None, help="proxy precision (default: the library's for this machine)")
    ap.add_argument("--only-probe", action="store_true", help="run the probe and BM25 only")
    ap.add_argument(
        "--titles",
        default="field",
        help="how HotpotQA titles are given, comma-separated: field (a title field), none (no title anywhere), text "
        "(the title as the text's first line); rows of the other regimes are named '<method> [titles: <regime>]'",
    )
    ap.add_argument("--no-bare-forward", action="store_true", help="skip the bare-forward latency reference")
    ap.add_argument("--out", default=str(RESULTS / "compression"))
    ap.add_argument("--report-only", action="store_true", help="re-print and re-plot the saved results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    if args.report_only:
        results = json.loads(out.with_suffix(".json").read_text())
        attach_llmlingua(results)
        plot(results, out.with_suffix(".png"))
        print_table(results)
        return
    bad = [t for t in args.titles.split(",") if t.strip() and t.strip() not in TITLE_REGIMES]
    if bad:
        raise SystemExit(f"unknown --titles {bad}: use a comma-separated list of {', '.join(TITLE_REGIMES)}")
    if not (data_dir() / "hotpotqa" / "dev.jsonl.gz").is_file():
        raise SystemExit(f"real data not found under {data_dir()}: this benchmark needs ../shared/data")
    results = run(args)
    attach_llmlingua(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print_table(results)


if __name__ == "__main__":
    main()
