"""A warm request, stage by stage: where the time goes once a request's documents are cached.

Held-out HotpotQA dev questions, 10 paragraphs each: every document set is read once (cold), then each set gets
other questions in turn, cycling through the sets so that no question finds the previous one's question buffer
(the common case for a server: many document sets interleaved). The same requests run with every cache format
given (``--formats``; the first is the baseline), interleaved request by request in a rotating order, and bare
forwards of the proxy over the same prompt are timed between them: in fp32 (an fp32 copy of the proxy, the
denominator of issue 51's warm target) on the threads a plain forward gets (every core this process may use) and
on one thread, and in the proxy's own precision (bf16 on a CPU with native bf16):

    python benchmarks/warm_path.py --sets 12 --formats bf16,k8v2,k5vh2q6 --decoded-max-bytes 0
    # → benchmarks/results/warm_path.json (every read decodes; the default keeps 256 MiB of decoded entries)

The floor (``--floor-rounds``, the default format only): the same warm requests again, unprofiled, timing the
question's own products in place (its packed linear layers and its attention over the cached keys, by wrappers
around the two functions), as shares of the bare fp32 forward the timed rounds measured over the same prompt, and
with the question pass on one thread and on two, interleaved with nothing else between them (as in a server: a
two-thread forward just before a request keeps the second thread awake and flatters two threads): what a warm
request cannot go below with this proxy and depth on this CPU (``floor`` in the results).

The timed rounds run without a profiler. Then every request runs again under cProfile (``--profile-rounds``; the
sets still interleaved, so no buffer is reused) and its time is split into stages: segmentation (the unit table),
the question pass's forward (its linear layers and its attention over the cached keys counted apart), assembling
the cached entries into the pass's buffer (decoding them), the cross-document reading, the probes, selection and
ordering.

Reported per format: the median warm request in ms and as a share of each bare forward (per-request ratios,
medians; ``warm_over_bare_fp32_median`` is the target's), and the median of each stage (profiled, so with
cProfile's overhead). The thread policy is the library's default (``--threads`` to change it); run without
``OMP_NUM_THREADS`` for the default settings.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
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
    "  its linear layers": [
        ("", "<built-in method torch._C._nn.linear>"),
        ("", "<built-in method torch._ops.mkldnn._linear_pointwise>"),  # prepacked (rag_opt.models.packed_linear)
    ],
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


class OwnProducts:
    """Unprofiled time in a question pass's own products: its packed linear layers and its attention over the
    cached keys. Installed before the model is packed (a packed layer binds ``packed_linear._forward`` then);
    counts only while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.ms = {"linear": 0.0, "attention": 0.0}

    def install(self) -> None:
        from rag_opt.models import capture, packed_linear

        for mod, name, label in ((packed_linear, "_forward", "linear"), (capture, "_question_attention", "attention")):
            inner = getattr(mod, name)

            def timed(*a: Any, _inner: Any = inner, _label: str = label, **k: Any) -> Any:
                if not self.on:
                    return _inner(*a, **k)
                t0 = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    self.ms[_label] += (time.perf_counter() - t0) * 1e3

            setattr(mod, name, timed)


def floor(
    opt: Any, sets: list[Any], bare: dict[tuple[int, int], float], own: OwnProducts, rounds: int
) -> dict[str, Any]:
    """Warm requests on the question pass's thread count (1) and on two, interleaved, each with its own products
    timed in place, as shares of the bare fp32 forward the timed rounds measured over the same prompt (``bare``, by
    set and question: no forward of another thread count runs between these requests, as none does in a server)."""
    from rag_opt.models import question_pass

    rows: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    was = question_pass.QUESTION_PASS_THREADS
    try:
        for j in range(rounds):
            for i, (docs, questions) in enumerate(sets):
                for n in (1, 2) if j % 2 == 0 else (2, 1):
                    question_pass.QUESTION_PASS_THREADS = n
                    own.ms = {"linear": 0.0, "attention": 0.0}
                    own.on = True
                    t0 = time.perf_counter()
                    opt.optimize(questions[j % 3], docs, ratio=1 / 3)
                    total = (time.perf_counter() - t0) * 1e3
                    own.on = False
                    rows[n].append({"warm": total, **own.ms, "bare": bare[(i, j % 3)]})
    finally:
        question_pass.QUESTION_PASS_THREADS = was
    out: dict[str, Any] = {"requests": len(rows[1]), "question_pass_threads": {}}
    for n, r in rows.items():
        out["question_pass_threads"][str(n)] = {
            "warm_ms_median": statistics.median(x["warm"] for x in r),
            "linear_ms_median": statistics.median(x["linear"] for x in r),
            "attention_ms_median": statistics.median(x["attention"] for x in r),
            "own_products_over_bare_fp32_median": statistics.median(
                (x["linear"] + x["attention"]) / x["bare"] for x in r
            ),
            "warm_over_bare_fp32_median": statistics.median(x["warm"] / x["bare"] for x in r),
        }
    out["two_threads_over_one_median"] = statistics.median(
        b["warm"] / a["warm"] for a, b in zip(rows[1], rows[2], strict=True)
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from rag_opt.compressors.sentinel import SentinelCompressor
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.kv_codec import DEFAULT_FORMAT, resolve_format
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.training.datasets import read_hotpotqa

    formats = [resolve_format(f).name for f in args.formats.split(",") if f]
    exs = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + args.sets * 4)
    exs = exs[args.offset :]
    sentinel = SentinelCompressor.from_model(None, encoding="parallel")
    threads: int | str = int(args.threads) if args.threads.isdigit() else args.threads
    from rag_opt.models.threads import ThreadPolicy

    sentinel.proxy.threads = ThreadPolicy(threads)
    own = OwnProducts()
    own.install()  # before the first question pass packs the model's linear layers
    spy = ContextSpy(sentinel)
    opt = ContextOptimizer(scorer=spy)
    decoded = {} if args.decoded_max_bytes is None else {"decoded_bytes": args.decoded_max_bytes}
    caches = {f: EncodingCache(4 << 30, format=f, **decoded) for f in formats}
    sets = []
    for i in tqdm(range(args.sets), desc="cold reads", mininterval=10):
        docs, _ = hotpot_documents(exs[4 * i], "field")
        for f in formats:  # every format's cache holds the set
            sentinel.cache = caches[f]
            opt.optimize(exs[4 * i].question, docs, ratio=1 / 3)
        sets.append((docs, [exs[4 * i + j].question for j in (1, 2, 3)]))
    fp32 = load_proxy_model(None, dtype="float32")
    default_threads = ThreadPolicy().choose()  # what a plain forward gets: every core this process may use
    bare_kinds = {
        "fp32": (fp32, default_threads),
        "fp32_one_thread": (fp32, 1),
        "native": (sentinel.proxy, default_threads),
    }
    ratios: dict[str, dict[str, list[float]]] = {f: {k: [] for k in bare_kinds} for f in formats}
    totals: dict[str, list[float]] = {f: [] for f in formats}
    per: dict[str, list[dict[str, float]]] = {f: [] for f in formats}
    bare_ms: dict[str, list[float]] = {k: [] for k in bare_kinds}
    bare_by_request: dict[tuple[int, int], float] = {}  # (set, question): the fp32 forward on its default threads
    for j in tqdm(range(3), desc="warm rounds (timed)", mininterval=10):
        for i, (docs, questions) in enumerate(sets):
            got: dict[str, float] = {}
            for k in range(len(formats)):
                f = formats[(k + j) % len(formats)]  # rotating order: noise hits every format alike
                sentinel.cache = caches[f]
                t0 = time.perf_counter()
                opt.optimize(questions[j], docs, ratio=1 / 3)
                totals[f].append((time.perf_counter() - t0) * 1e3)
                if not got and spy.last is not None:
                    for name, (model, n) in bare_kinds.items():
                        torch.set_num_threads(n)
                        got[name] = bare_forward_ms(model, spy.last[1], spy.last[0])
                        bare_ms[name].append(got[name])
                    bare_by_request[(i, j)] = got["fp32"]
            for f in formats:
                for name in got:
                    ratios[f][name].append(totals[f][-1] / got[name])
    for j in tqdm(range(args.profile_rounds), desc="warm rounds (profiled)", mininterval=10):
        for docs, questions in sets:
            for k in range(len(formats)):
                f = formats[(k + j) % len(formats)]
                sentinel.cache = caches[f]
                prof = cProfile.Profile()
                prof.enable()
                opt.optimize(questions[j % 3], docs, ratio=1 / 3)
                prof.disable()
                per[f].append(_stage_ms(pstats.Stats(prof)))
    floor_format = DEFAULT_FORMAT if DEFAULT_FORMAT in formats else formats[0]
    sentinel.cache = caches[floor_format]
    floor_res = floor(opt, sets, bare_by_request, own, args.floor_rounds) if args.floor_rounds else None
    out: dict[str, Any] = {
        "sets": args.sets,
        "threads": args.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "proxy_precision": sentinel.proxy.precision,
        "decoded_max_bytes": caches[formats[0]].decoded.max_bytes,
        "bare_forward_threads": {k: n for k, (_, n) in bare_kinds.items()},
        "bare_forward_ms_median": {k: statistics.median(v) for k, v in bare_ms.items() if v},
        "formats": {},
    }
    if floor_res is not None:
        out["floor"] = {"format": floor_format, **floor_res}
    for f in formats:
        out["formats"][f] = {
            "warm_ms_median": statistics.median(totals[f]),
            **{f"warm_over_bare_{k}_median": statistics.median(v) if v else None for k, v in ratios[f].items()},
            "stages_ms_median (profiled)": {s: statistics.median(r[s] for r in per[f]) for s in STAGES}
            if per[f]
            else {},
            "requests": len(totals[f]),
        }
        if f != formats[0]:
            pairs = zip(totals[f], totals[formats[0]], strict=True)
            out["formats"][f]["over_baseline_median"] = statistics.median(a / b for a, b in pairs)
    return out


def show(res: dict[str, Any]) -> None:
    for f, r in res["formats"].items():
        logger.info(
            "%s: warm %.1f ms (%.4fx a bare fp32 forward, %.4fx one on one thread, %.4fx one in its own precision), "
            "%d requests%s",
            f,
            r["warm_ms_median"],
            r["warm_over_bare_fp32_median"] or float("nan"),
            r["warm_over_bare_fp32_one_thread_median"] or float("nan"),
            r["warm_over_bare_native_median"] or float("nan"),
            r["requests"],
            f"; {r['over_baseline_median']:.3f}x the baseline" if "over_baseline_median" in r else "",
        )
        for stage, ms in r["stages_ms_median (profiled)"].items():
            logger.info("  %-45s %7.1f ms", stage, ms)
    fl = res.get("floor")
    if fl:
        for n, r in fl["question_pass_threads"].items():
            logger.info(
                "floor (%s), question pass on %s thread(s): warm %.1f ms (%.4fx a bare fp32 forward); its linear "
                "layers %.1f ms + its attention %.1f ms = %.4fx a bare fp32 forward",
                fl["format"],
                n,
                r["warm_ms_median"],
                r["warm_over_bare_fp32_median"],
                r["linear_ms_median"],
                r["attention_ms_median"],
                r["own_products_over_bare_fp32_median"],
            )
        logger.info("two threads / one: %.2fx (%d requests each)", fl["two_threads_over_one_median"], fl["requests"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", type=int, default=12, help="document sets (each with 3 warm questions)")
    ap.add_argument("--offset", type=int, default=1000, help="dev questions skipped first (held out of other runs)")
    ap.add_argument("--formats", default="bf16", help="cache formats, the baseline first")
    ap.add_argument("--threads", default="auto", help="the thread policy: auto, adaptive or a number")
    ap.add_argument("--profile-rounds", type=int, default=3, help="profiled rounds after the timed ones (0: none)")
    ap.add_argument(
        "--decoded-max-bytes",
        type=int,
        default=None,
        help="the caches' bound of decoded compact entries (EncodingCache decoded_bytes; default: the library's)",
    )
    ap.add_argument(
        "--floor-rounds", type=int, default=2, help="rounds of the floor: own products timed, 1 vs 2 threads (0: none)"
    )
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
