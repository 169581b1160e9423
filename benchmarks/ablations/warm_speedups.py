"""A warm request with and without the warm path's speedups, interleaved: prepacked weights for the question pass's
small products (:mod:`rag_opt.models.packed_linear`) and FBGEMM's fused decoding of per-row codes
(:mod:`rag_opt.models.kv_rowwise`).

    python benchmarks/ablations/warm_speedups.py --seconds 120      # → benchmarks/results/warm_speedups.json

Six held-out HotpotQA document sets (dev, from question 1000: held out of the other runs) are read once into a
``bf16`` and a ``k8v2`` cache; then, round after round, every set gets another question under each arm in a rotating
order (so load drifts hit every arm alike), with the question buffer emptied before each request (nothing decoded
is reused). The arms: each format with neither speedup (``plain``), with packed weights (``packed``), and with both
(``both``). Reported per arm: the median request in ms and the median of its per-request ratio to the first arm;
and whether every arm kept the same text for every request (both speedups give the same numbers bit for bit).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir  # noqa: E402
from compression import hotpot_documents  # noqa: E402

logger = logging.getLogger("bench.warm_speedups")
RESULTS = Path(__file__).resolve().parents[1] / "results"
ARMS = ("k8v2:plain", "k8v2:packed", "k8v2:both", "bf16:plain", "bf16:packed", "bf16:both")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rag_opt.compressors.sentinel import SentinelCompressor
    from rag_opt.models import kv_rowwise, packed_linear, question_buffer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.training.datasets import read_hotpotqa

    exs = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + 4 * args.sets)
    exs = exs[args.offset :]
    sentinel = SentinelCompressor.from_model(None, encoding="parallel")
    opt = ContextOptimizer(scorer=sentinel)
    caches = {f: EncodingCache(4 << 30, format=f) for f in ("bf16", "k8v2")}
    sets = []
    for i in range(args.sets):
        docs, _ = hotpot_documents(exs[4 * i], "field")
        for cache in caches.values():
            sentinel.cache = cache
            opt.optimize(exs[4 * i].question, docs, ratio=1 / 3)
        sets.append((docs, [exs[4 * i + j].question for j in (1, 2, 3)]))
    fused = kv_rowwise.rowwise_decode
    rows = packed_linear.PACKED_MAX_ROWS
    ms: dict[str, list[float]] = {a: [] for a in ARMS}
    kept: dict[str, list[str]] = {a: [] for a in ARMS}
    end, n = time.monotonic() + args.seconds, 0
    try:
        while time.monotonic() < end or n < 1:
            for docs, questions in sets:
                for j in range(len(ARMS)):
                    arm = ARMS[(j + n) % len(ARMS)]
                    fmt, speedups = arm.split(":")
                    sentinel.cache = caches[fmt]
                    packed_linear.PACKED_MAX_ROWS = 0 if speedups == "plain" else rows
                    kv_rowwise.rowwise_decode = fused if speedups == "both" else (lambda *a: None)  # type: ignore[assignment]
                    question_buffer.forget(sentinel.proxy)  # nothing decoded is reused
                    caches[fmt].decoded.clear()
                    t = time.perf_counter()
                    res = opt.optimize(questions[n % 3], docs, ratio=1 / 3)
                    ms[arm].append((time.perf_counter() - t) * 1e3)
                    kept[arm].append(res.context())
            n += 1
    finally:
        packed_linear.PACKED_MAX_ROWS = rows
        kv_rowwise.rowwise_decode = fused
    base = ARMS[0]
    return {
        "sets": args.sets,
        "rounds": n,
        "arms": {
            a: {
                "median_ms": statistics.median(v),
                f"over_{base}_median": statistics.median(x / y for x, y in zip(v, ms[base], strict=True)),
                "requests": len(v),
            }
            for a, v in ms.items()
        },
        # within a format every arm keeps the same text (across formats the entries differ)
        "same_text_within_format": all(
            kept[a] == kept[f"{a.split(':')[0]}:plain"] for a in ARMS if not a.endswith(":plain")
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", type=int, default=6)
    ap.add_argument("--offset", type=int, default=1000, help="dev questions skipped first (held out of other runs)")
    ap.add_argument("--seconds", type=float, default=120.0, help="run rounds for this long (at least one)")
    ap.add_argument("--out", default=str(RESULTS / "warm_speedups.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for arm, r in res["arms"].items():
        logger.info(
            "%-12s %6.1f ms  %.3fx %s  (%d requests)",
            arm,
            r["median_ms"],
            r[f"over_{ARMS[0]}_median"],
            ARMS[0],
            r["requests"],
        )
    logger.info("same text within each format: %s", res["same_text_within_format"])


if __name__ == "__main__":
    main()
