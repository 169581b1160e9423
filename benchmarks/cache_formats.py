"""Compact cache entries: every cache format's bytes per document token, quality and warm latency against today's
bf16 entries, paired on the same questions in one run.

Each question's documents are encoded once (bf16, the model's dtype, as today); every format's cache is then filled
from those same states (quantized by the format) and the question is answered from it, warm. So the formats differ
only in how the cached states were stored, and each is paired with bf16 on the same questions:

    OMP_NUM_THREADS=1 python benchmarks/cache_formats.py --hotpot 600 --nq 45     # → results/cache_formats.json
    OMP_NUM_THREADS=1 python benchmarks/cache_formats.py --hotpot 0 --records 60 \
        --out benchmarks/results/cache_formats_records.json

HotpotQA dev (titles given as a field and not at all; ratios 1/3 and 1/5): supporting-fact recall and answer kept,
per format, with the paired difference against bf16 and its 95 % bootstrap interval. ``--nq N``: the NQ
multi-document setting (N questions at 10, 20 and 30 documents, the gold passage at every fifth slot): gold passage
kept and answer kept at 1/3. ``--records N``: lookups in JSON record lists (the structured-record test set of
``benchmarks/ablations/probe_transfer.py``). Bytes: each format's entries as stored (serialized, everything
included: the prefix, every block and its source queries) over the document tokens they hold. Warm latency: the
first question over cached documents (the question buffer assembled, i.e. the entries decoded) and a bare fp32
forward of the proxy over the same prompt, interleaved per question.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from common import data_dir, paired_bootstrap
from compression import ContextSpy, bare_forward_ms, hotpot_documents, hotpot_metrics

from rag_opt.models import question_buffer
from rag_opt.models.encoding_cache import EncodingCache
from rag_opt.models.kv_codec import FORMATS
from rag_opt.models.parallel_features import CROSS_READS
from rag_opt.pipeline import ContextOptimizer
from rag_opt.training.datasets import contains_answer, read_hotpotqa

logger = logging.getLogger("bench.cache_formats")
RESULTS = Path(__file__).resolve().parent / "results"
BIG = 8 << 30


class RecordingCache(EncodingCache):
    """A bf16 cache that remembers every state it was given, by content key (to fill the other formats' caches)."""

    def __init__(self) -> None:
        super().__init__(BIG, format="bf16")
        self.raw: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> Any:
        self.raw[key] = value
        return super().put(key, value)


def _filled(fmt: str, raw: dict[str, Any]) -> tuple[EncodingCache, int]:
    """A cache of format ``fmt`` holding ``raw``'s states, and the bytes they take serialized."""
    cache = EncodingCache(BIG, format=fmt)
    size = 0
    for k, v in raw.items():
        entry = cache.put(k, v)
        size += len(entry.to_bytes(cache.store_key(k)))
    return cache, size


def _doc_tokens(raw: dict[str, Any]) -> int:
    """Document tokens held: the blocks' (kv entries other than the prefix's)."""
    return sum(int(v.shape[3]) for v in raw.values() if v.dim() == 5 and v.shape[3] > 0)


def _probe_arms(specs: list[str]) -> dict[str, tuple[str, str]]:
    """``--probe NAME=FORMAT:PATH`` arms: entries of FORMAT read by the sentence probe at PATH."""
    out: dict[str, tuple[str, str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        fmt, sep2, path = rest.partition(":")
        if not (sep and sep2 and name and fmt and path):
            raise SystemExit(f"--probe {spec!r}: expected NAME=FORMAT:PATH")
        if not Path(path).is_file():
            raise SystemExit(f"--probe {spec!r}: no probe file at {path}")
        out[name] = (fmt, path)
    return out


def merged(paths: list[str]) -> dict[str, Any]:
    """The summary of several runs' ``--rows-out`` files (disjoint questions: ``--offset``), as one run's, over the
    formats every run compared (the first run's order; bf16 first in each)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    formats = [f for f in first["formats"] if all(f in part["formats"] for part in parts)]
    for part in parts[1:]:
        if (part["regimes"], part["ratios"]) != (first["regimes"], first["ratios"]) or part["formats"][0] != formats[0]:
            raise SystemExit("--merge: the runs compare other titles or ratios, or another baseline")
    if len(formats) < 2:
        raise SystemExit("--merge: the runs share no format besides the baseline")
    keys = [k for k in first["rows"] if k.split("|")[0] in formats]
    rows = {k: [r for part in parts for r in part["rows"].get(k, [])] for k in keys}
    sizes = {f: [n for part in parts for n in part["sizes"][f]] for f in formats}
    warm = {f: [w for part in parts for w in part["warm"][f]] for f in formats}
    tokens = [t for part in parts for t in part["tokens"]]
    bare = [b for part in parts for b in part["bare"]]
    out = _summary(formats, first["regimes"], first["ratios"], rows, sizes, tokens, warm, bare)
    out["merged"] = paths
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from rag_opt.compressors.sentinel import SentinelCompressor

    formats = [f for f in args.formats.split(",") if f]
    probed = _probe_arms(args.probe)  # arm name → (its format, its sentence probe)
    for f in [*formats, *(fmt for fmt, _ in probed.values())]:
        if f not in FORMATS:
            raise SystemExit(f"unknown format {f!r}: use {', '.join(FORMATS)}")
    ratios = [float(Fraction(r)) for r in args.ratios.split(",")]
    regimes = [t for t in args.titles.split(",") if t]
    hotpot = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + args.hotpot)
    hotpot = hotpot[args.offset :]
    sentinel = SentinelCompressor.from_model(None, encoding="parallel")
    spy = ContextSpy(sentinel)
    opt = ContextOptimizer(scorer=spy)
    # every arm: its format, the compressor that reads it and its pipeline (a --probe arm: another sentence probe)
    arms: dict[str, tuple[str, Any, ContextOptimizer]] = {f: (f, sentinel, opt) for f in formats}
    for name, (fmt, path) in probed.items():
        other = SentinelCompressor(sentinel.proxy, path, encoding="parallel")
        arms[name] = (fmt, other, ContextOptimizer(scorer=other))
    plain, formats = formats, list(arms)
    rows: dict[str, list[dict[str, Any]]] = {}  # "fmt|titles|ratio" → per-question metrics
    sizes: dict[str, list[int]] = {f: [] for f in formats}
    tokens: list[int] = []
    warm: dict[str, list[float]] = {f: [] for f in formats}
    bare: list[float] = []
    log = Path(args.log) if args.log else None
    for qi, ex in enumerate(tqdm(hotpot, desc="hotpot", mininterval=10)):
        for titles in regimes:
            docs, shifts = hotpot_documents(ex, titles)
            rec = RecordingCache()
            sentinel.cache = rec
            opt.optimize(ex.question, docs, ratio=ratios[0])  # encodes every block once, in bf16
            if titles == regimes[0]:
                tokens.append(_doc_tokens(rec.raw))
            for fmt, (stored, reader, pipeline) in arms.items():
                cache, size = _filled(stored, rec.raw)
                reader.cache = cache
                # every format's first question starts alike: nothing of these documents read yet but their entries
                CROSS_READS.clear()
                question_buffer.forget(sentinel.proxy)
                for r in ratios:
                    t0 = time.perf_counter()
                    res = pipeline.optimize(ex.question, docs, ratio=r)
                    ms = (time.perf_counter() - t0) * 1e3
                    if titles == regimes[0] and r == ratios[0]:
                        warm[fmt].append(ms)
                        sizes[fmt].append(size)
                    row = hotpot_metrics(ex, res, shifts)
                    row["kept"] = res.context()  # to count the questions whose kept text differs from bf16's
                    rows.setdefault(f"{fmt}|{titles}|{r:.3f}", []).append(row)
            sentinel.cache = rec
            if titles == regimes[0] and spy.last is not None:
                bare.append(bare_forward_ms(sentinel.proxy, spy.last[1], spy.last[0]))
        if log is not None and (qi + 1) % 25 == 0:
            log.write_text(json.dumps(_summary(formats, regimes, ratios, rows, sizes, tokens, warm, bare), indent=1))
    out = _summary(formats, regimes, ratios, rows, sizes, tokens, warm, bare)
    if args.rows_out:  # every question's figures, for --merge (the kept text as its digest)
        per = {k: [{**r, "kept": hashlib.sha256(r["kept"].encode()).hexdigest()} for r in v] for k, v in rows.items()}
        raw = {"formats": formats, "regimes": regimes, "ratios": ratios, "rows": per, "sizes": sizes}
        raw.update({"tokens": tokens, "warm": warm, "bare": bare})
        Path(args.rows_out).write_text(json.dumps(raw))
    if args.records:
        out["records"] = run_records(args, sentinel, opt, plain)
    if args.nq:
        out["nq"] = run_nq(args, sentinel, opt, plain)
    return out


def run_nq(args: argparse.Namespace, sentinel: Any, opt: ContextOptimizer, formats: list[str]) -> dict[str, Any]:
    """NQ multi-document (held-out test split): the gold passage ranked first / in the top 3 by document relevance,
    and the answer kept at 1/3, per format, at 10, 20 and 30 documents (the gold passage at every fifth slot in
    turn; under parallel encoding a document's features do not depend on its slot)."""
    from tqdm.auto import tqdm

    from rag_opt.training.nq_contexts import nq_records

    records = nq_records(data_dir() / "nq_multidoc" / "public.jsonl.gz", "test")[: args.nq]
    out: dict[str, Any] = {}
    for n_docs in (10, 20, 30):
        per: dict[str, dict[str, list[float]]] = {f: {"r1": [], "r3": [], "answer": []} for f in formats}
        slots = list(range(0, n_docs, 5))
        for i, ex in enumerate(tqdm(records, desc=f"nq {n_docs}", mininterval=10)):
            slot = slots[i % len(slots)]
            docs = [{"id": str(j), **d} for j, d in enumerate(ex.documents(n_docs, slot))]
            rec = RecordingCache()
            sentinel.cache = rec
            opt.optimize(ex.question, docs, ratio=1 / 3)
            for fmt in formats:
                cache, _ = _filled(fmt, rec.raw)
                sentinel.cache = cache
                res = opt.optimize(ex.question, docs, ratio=1 / 3, ordering="relevance")
                ranked = [d.id for d in sorted(res.documents, key=lambda d: -(d.score or 0.0))]
                rank = ranked.index(str(slot)) if str(slot) in ranked else n_docs
                per[fmt]["r1"].append(float(rank < 1))
                per[fmt]["r3"].append(float(rank < 3))
                per[fmt]["answer"].append(float(any(contains_answer(res.context(), a) for a in ex.answers)))
        out[str(n_docs)] = {
            f: {
                **{m: float(np.mean(v)) for m, v in per[f].items()},
                "vs_bf16": {m: paired_bootstrap(per["bf16"][m], per[f][m]) for m in per[f]} if "bf16" in per else None,
            }
            for f in formats
        }
    return out


def run_records(args: argparse.Namespace, sentinel: Any, opt: ContextOptimizer, formats: list[str]) -> dict[str, Any]:
    """Lookups in a JSON list of 60 product records and in the same records as CSV ("How much does item k
    cost?", a budget of less than one record; ``benchmarks/ablations/record_terms.py``): the asked record kept, per
    format."""
    import random
    import sys

    from tqdm.auto import tqdm

    sys.path.insert(0, str(Path(__file__).resolve().parent / "ablations"))
    from record_terms import BUDGET, RECORDS, documents, kept_record

    docs = documents()
    ks = random.Random(0).sample(range(1, len(RECORDS) + 1), args.records)
    kept: dict[str, dict[str, list[float]]] = {f: {shape: [] for shape in docs} for f in formats}
    for shape, text in docs.items():
        rec = RecordingCache()
        sentinel.cache = rec
        opt.optimize("How much does item 1 cost?", [text], target_tokens=BUDGET)
        caches = {f: _filled(f, rec.raw)[0] for f in formats}
        for k in tqdm(ks, desc=f"records ({shape})", mininterval=10):
            for fmt in formats:
                sentinel.cache = caches[fmt]
                result = opt.optimize(f"How much does item {k} cost?", [text], target_tokens=BUDGET)
                kept[fmt][shape].append(float(kept_record(result, text, shape, k)))
    return {
        f: {
            shape: {
                "record_kept": float(np.mean(v)),
                "vs_bf16": paired_bootstrap(kept["bf16"][shape], v) if "bf16" in kept else None,
            }
            for shape, v in kept[f].items()
        }
        for f in formats
    }


def _summary(
    formats: list[str],
    regimes: list[str],
    ratios: list[float],
    rows: dict[str, list[dict[str, Any]]],
    sizes: dict[str, list[int]],
    tokens: list[int],
    warm: dict[str, list[float]],
    bare: list[float],
) -> dict[str, Any]:
    n = len(tokens)
    out: dict[str, Any] = {"questions": n, "formats": {}}
    for fmt in formats:
        entry: dict[str, Any] = {
            "bytes_per_token": sum(sizes[fmt][:n]) / max(1, sum(tokens[: len(sizes[fmt])])),
            "warm_ms_median": statistics.median(warm[fmt]) if warm[fmt] else None,
            "warm_over_bare_forward": statistics.median([w / b for w, b in zip(warm[fmt], bare, strict=False) if b > 0])
            if bare
            else None,
        }
        for titles in regimes:
            for r in ratios:
                key = f"{fmt}|{titles}|{r:.3f}"
                base = rows.get(f"bf16|{titles}|{r:.3f}", [])
                mine = rows.get(key, [])
                m = min(len(base), len(mine))
                cell: dict[str, Any] = {}
                for metric in ("sf_recall", "answer_retention"):
                    vals = [x[metric] for x in mine if x[metric] is not None]
                    cell[metric] = float(np.mean(vals)) if vals else None
                    if base and fmt != "bf16":
                        cell[metric + "_vs_bf16"] = paired_bootstrap(
                            [x[metric] for x in base[:m]], [x[metric] for x in mine[:m]]
                        )
                if base and fmt != "bf16":
                    cell["kept_differs"] = sum(
                        a["kept"] != b["kept"] for a, b in zip(base[:m], mine[:m], strict=True)
                    ) / max(1, m)
                entry[f"{titles} {r:.3f}"] = cell
        out["formats"][fmt] = entry
    out["bare_forward_ms_median"] = statistics.median(bare) if bare else None
    return out


def show(res: dict[str, Any]) -> None:
    logger.info("questions: %s", res["questions"])
    for fmt, e in res["formats"].items():
        cells = {k: v for k, v in e.items() if isinstance(v, dict)}
        parts = []
        for k, v in cells.items():
            if v.get("sf_recall") is None:
                continue
            d = v.get("sf_recall_vs_bf16", {}).get("diff")
            a = v.get("answer_retention_vs_bf16", {}).get("diff")
            parts.append(
                f"{k}: {v['sf_recall']:.3f}/{v['answer_retention']:.3f}"
                + (f" ({d:+.4f}/{a:+.4f}, {v['kept_differs']:.2f} differ)" if d is not None else "")
            )
        logger.info(
            "%-5s %7.0f B/token  warm %.0f ms (%.3fx bare)  %s",
            fmt,
            e["bytes_per_token"],
            e["warm_ms_median"] or float("nan"),
            e["warm_over_bare_forward"] or float("nan"),
            "  ".join(parts),
        )


def _show_extra(res: dict[str, Any]) -> None:
    for n, per in res.get("nq", {}).items():
        for fmt, v in per.items():
            vs = v.get("vs_bf16") or {}
            logger.info(
                "NQ %s docs %-5s R@1 %.3f R@3 %.3f answer kept %.3f  vs bf16: %s",
                n,
                fmt,
                v["r1"],
                v["r3"],
                v["answer"],
                " ".join(f"{m} {d['diff']:+.4f}" for m, d in vs.items() if d.get("diff") is not None),
            )
    for fmt, per in res.get("records", {}).items():
        logger.info("records %-5s %s", fmt, "  ".join(f"{shape} {v['record_kept']:.3f}" for shape, v in per.items()))


def markdown(res: dict[str, Any]) -> str:
    """The formats as a markdown table (docs/operations.md): bytes per token, warm latency against a bare forward,
    and each HotpotQA cell's facts / answers kept with the paired difference against bf16."""
    fmts = res["formats"]
    cells = [k for k, v in next(iter(fmts.values())).items() if isinstance(v, dict)]
    head = ["format", "bytes / doc token", "warm (× bare fwd)", *[f"{c}: facts / answers" for c in cells]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fmt, e in fmts.items():
        row = [f"`{fmt}`", f"{e['bytes_per_token']:,.0f}", f"{e['warm_over_bare_forward']:.3f}"]
        for c in cells:
            v = e[c]
            text = f"{v['sf_recall']:.3f} / {v['answer_retention']:.3f}"
            d, a = v.get("sf_recall_vs_bf16", {}).get("diff"), v.get("answer_retention_vs_bf16", {}).get("diff")
            if d is not None and a is not None:
                text += f" ({d:+.4f} / {a:+.4f})"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hotpot", type=int, default=600, help="HotpotQA dev questions")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--formats", default=",".join(FORMATS), help="cache formats to compare (bf16 first)")
    ap.add_argument(
        "--probe",
        action="append",
        default=[],
        metavar="NAME=FORMAT:PATH",
        help="also an arm NAME: FORMAT's entries read by another sentence probe (benchmarks/ablations/"
        "probe_on_format.py trains one on a format's states)",
    )
    ap.add_argument("--rows-out", default=None, help="also write every question's figures here (for --merge)")
    ap.add_argument(
        "--merge", default=None, help="comma-separated --rows-out files: their summary, as one run's (shared formats)"
    )
    ap.add_argument("--ratios", default="1/3,1/5")
    ap.add_argument("--titles", default="field,none")
    ap.add_argument("--nq", type=int, default=0, help="also the NQ multi-document setting, N questions")
    ap.add_argument(
        "--records", type=int, default=0, help="also K structured-record lookups (JSON and CSV, at most 60)"
    )
    ap.add_argument("--log", default=None, help="write the running summary here every 25 questions")
    ap.add_argument("--out", default=str(RESULTS / "cache_formats.json"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="with --report-only: print the docs' markdown table")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.markdown:
        logger.info("%s", markdown(json.loads(Path(args.out).read_text())))
        return
    from common import run_or_report

    job = (lambda: merged(args.merge.split(","))) if args.merge else (lambda: run(args))
    run_or_report(Path(args.out), args.report_only, job, lambda r: (show(r), _show_extra(r)))


if __name__ == "__main__":
    main()
