"""A warm request, stage by stage: where the time goes once a request's documents are cached.

Held-out HotpotQA dev questions, 10 paragraphs each: every document set is read once (cold), then each set gets
other questions in turn, cycling through the sets so that no question finds the previous one's question buffer
(the common case for a server: many document sets interleaved). Each warm request is profiled (cProfile) and its
time split into stages: segmentation (the unit table), the question pass's forward (its linear layers and its
attention over the cached keys counted apart), assembling the cached entries into the pass's buffer (decoding them),
the cross-document reading, the probes, selection and ordering. The same requests run with every cache format
given (``--formats``; the first is the baseline), interleaved request by request, and a bare fp32 forward of the
proxy over the same prompt is timed between them:

    python benchmarks/warm_path.py --sets 12 --formats bf16,k8v2     # → benchmarks/results/warm_path.json

Reported per format: the median warm request in ms and as a share of the bare forward (per-request ratio, median),
and the median of each stage. The thread policy is the library's default (``--threads`` to change it).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import data_dir  # noqa: E402
from compression import ContextSpy, bare_forward_ms, hotpot_documents  # noqa: E402

logger = logging.getLogger("bench.warm_path")
RESULTS = Path(__file__).resolve().parent / "results"

# stage → the functions whose cumulative time it is (module file suffix, function name)
STAGES: dict[str, list[tuple[str, str]]] = {
    "segmentation (unit table)": [("text/units.py", "build")],
    "question pass: forward": [("models/question_pass.py", "run_question_passes")],
    "  its linear layers": [("", "<built-in method torch._C._nn.linear>")],
    "  its attention over the cached keys": [("models/capture.py", "_question_attention")],
    "  assembling the cached entries (decoding)": [("models/question_buffer.py", "assemble_states")],
    "cross-document reading": [("models/parallel_cross.py", "cross_reads")],
    "probes": [("compressors/sentinel.py", "_scores")],
    "selection": [("compressors/selection.py", "select")],
    "ordering": [("orderers/", "order")],
}


def _stage_ms(stats: pstats.Stats) -> dict[str, float]:
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for stage, funcs in STAGES.items():
        total = 0.0
        for suffix, name in funcs:
            for (path, _line, fn), (_cc, _nc, _tt, ct, _callers) in raw.items():
                if fn == name and (not suffix or suffix in path.replace("\\", "/")):
                    total += ct
        out[stage] = total * 1e3
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from rag_opt.compressors.sentinel import SentinelCompressor
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.kv_codec import resolve_format
    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.training.datasets import read_hotpotqa

    formats = [resolve_format(f).name for f in args.formats.split(",") if f]
    exs = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + args.sets * 4)
    exs = exs[args.offset :]
    sentinel = SentinelCompressor.from_model(None, encoding="parallel")
    threads: int | str = int(args.threads) if args.threads.isdigit() else args.threads
    from rag_opt.models.threads import ThreadPolicy

    sentinel.proxy.threads = ThreadPolicy(threads)
    spy = ContextSpy(sentinel)
    opt = ContextOptimizer(scorer=spy)
    caches = {f: EncodingCache(4 << 30, format=f) for f in formats}
    sets = []
    for i in tqdm(range(args.sets), desc="cold reads", mininterval=10):
        docs, _ = hotpot_documents(exs[4 * i], "field")
        for f in formats:  # every format's cache holds the set
            sentinel.cache = caches[f]
            opt.optimize(exs[4 * i].question, docs, ratio=1 / 3)
        sets.append((docs, [exs[4 * i + j].question for j in (1, 2, 3)]))
    per: dict[str, list[dict[str, float]]] = {f: [] for f in formats}
    totals: dict[str, list[float]] = {f: [] for f in formats}
    ratios: dict[str, list[float]] = {f: [] for f in formats}
    for j in tqdm(range(3), desc="warm rounds", mininterval=10):
        for docs, questions in sets:
            bare = None
            for k in range(len(formats)):
                f = formats[(k + j) % len(formats)]  # rotating order: noise hits every format alike
                sentinel.cache = caches[f]
                prof = cProfile.Profile()
                t0 = time.perf_counter()
                prof.enable()
                opt.optimize(questions[j], docs, ratio=1 / 3)
                prof.disable()
                ms = (time.perf_counter() - t0) * 1e3
                if bare is None and spy.last is not None:
                    bare = bare_forward_ms(sentinel.proxy, spy.last[1], spy.last[0])
                per[f].append(_stage_ms(pstats.Stats(prof)))
                totals[f].append(ms)
                if bare:
                    ratios[f].append(ms / bare)
    out: dict[str, Any] = {"sets": args.sets, "threads": args.threads, "formats": {}}
    for f in formats:
        out["formats"][f] = {
            "warm_ms_median": statistics.median(totals[f]),
            "warm_over_bare_forward_median": statistics.median(ratios[f]) if ratios[f] else None,
            "stages_ms_median": {s: statistics.median(r[s] for r in per[f]) for s in STAGES},
            "requests": len(totals[f]),
        }
    return out


def show(res: dict[str, Any]) -> None:
    for f, r in res["formats"].items():
        logger.info(
            "%s: warm %.0f ms (%.4fx a bare fp32 forward), %d requests",
            f,
            r["warm_ms_median"],
            r["warm_over_bare_forward_median"] or float("nan"),
            r["requests"],
        )
        for stage, ms in r["stages_ms_median"].items():
            logger.info("  %-45s %7.1f ms", stage, ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", type=int, default=12, help="document sets (each with 3 warm questions)")
    ap.add_argument("--offset", type=int, default=1000, help="dev questions skipped first (held out of other runs)")
    ap.add_argument("--formats", default="bf16", help="cache formats, the baseline first")
    ap.add_argument("--threads", default="auto", help="the thread policy: auto, adaptive or a number")
    ap.add_argument("--out", default=str(RESULTS / "warm_path.json"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    res = json.loads(out.read_text()) if args.report_only else run(args)
    if not args.report_only:
        out.write_text(json.dumps(res, indent=1))
    show(res)


if __name__ == "__main__":
    main()
