"""Can a batch of warm questions share its attention work? The question pass's products at its real shapes.

    OMP_NUM_THREADS=1 python benchmarks/ablations/batch_attention.py  # results/batch_attention.json

A warm ``optimize_batch`` of 16 questions over one cached document set spends most of its time in each question's
own attention over the cached keys (``docs/benchmarks.md``, "Batches"), which a single call computes too. This
measures that attention for one layer at the embedded proxy's shapes (9 query heads sharing 3 key/value heads of 64
dimensions, ``--keys`` cached tokens, 16 questions of 22 tokens), medians of ``--repeat`` interleaved rounds:

* ``per question``: each question's two products and softmax in float32, one after the other (what rag-opt runs);
* ``stacked``: every question's queries in one product against the shared keys (float32; the query-key product
  alone, then the whole attention with each question's own keys appended, merged by the softmax);
* ``bf16``: the per-question and stacked query-key products in bfloat16 (AMX where the CPU has it), whose logits
  are rounded to 8 bits (the recorded attention rows would change);
* ``two threads``: the per-question loop at two torch threads, and the questions split over two Python threads at
  one torch thread each.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
KV_HEADS, GROUP, DIM, QUESTION_TOKENS, QUESTIONS = 3, 3, 64, 22, 16
logger = logging.getLogger("batch_attention")


def run(keys: int, repeat: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    heads, n, q_count = KV_HEADS * GROUP, QUESTION_TOKENS, QUESTIONS
    k_all = torch.randn(KV_HEADS, keys + q_count * n, DIM)
    v_all = torch.randn(KV_HEADS, keys + q_count * n, DIM)
    q = torch.randn(q_count, KV_HEADS, GROUP * n, DIM) * DIM**-0.5
    kt = k_all[:, :keys].transpose(-1, -2).contiguous()
    stacked_q = q.permute(1, 0, 2, 3).reshape(KV_HEADS, q_count * GROUP * n, DIM).contiguous()

    def one(i: int) -> torch.Tensor:  # question i reads the cached keys, then the questions' tokens up to its own
        end = keys + (i + 1) * n
        logits = torch.matmul(q[i], k_all[:, :end].transpose(-1, -2)).view(heads, n, end)
        probs = torch.softmax(logits, dim=-1)
        return torch.matmul(probs.view(KV_HEADS, GROUP * n, end), v_all[:, :end])

    def per_question() -> None:
        for i in range(q_count):
            one(i)

    def stacked_attention() -> None:
        shared = torch.matmul(stacked_q, kt).view(KV_HEADS, q_count, GROUP * n, keys)
        own = torch.stack(
            [torch.matmul(q[i], k_all[:, keys + i * n : keys + (i + 1) * n].transpose(-1, -2)) for i in range(q_count)],
            dim=1,
        )
        top = torch.maximum(shared.amax(-1), own.amax(-1)).unsqueeze(-1)
        e_shared, e_own = torch.exp(shared - top), torch.exp(own - top)
        total = e_shared.sum(-1, keepdim=True) + e_own.sum(-1, keepdim=True)
        out = torch.matmul((e_shared / total).reshape(KV_HEADS, -1, keys), v_all[:, :keys])
        out += torch.stack(
            [
                torch.matmul((e_own[:, i] / total[:, i]), v_all[:, keys + i * n : keys + (i + 1) * n])
                for i in range(q_count)
            ],
            dim=1,
        ).reshape(KV_HEADS, -1, DIM)

    qb, ktb, stacked_qb = q.bfloat16(), kt.bfloat16(), stacked_q.bfloat16()
    pool = ThreadPoolExecutor(2)
    arms: dict[str, tuple[Callable[[], Any], int]] = {
        "per question, float32": (per_question, 1),
        "per question, query-key product only": (lambda: [torch.matmul(q[i], kt) for i in range(q_count)], 1),
        "stacked, query-key product only": (lambda: torch.matmul(stacked_q, kt), 1),
        "stacked, whole attention": (stacked_attention, 1),
        "bf16 per question, query-key product only": (lambda: [torch.matmul(qb[i], ktb) for i in range(q_count)], 1),
        "bf16 stacked, query-key product only": (lambda: torch.matmul(stacked_qb, ktb), 1),
        "per question, two torch threads": (per_question, 2),
        "per question, two Python threads": (lambda: list(pool.map(one, range(q_count))), 1),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeat):
        for name, (fn, threads) in arms.items():  # interleaved: the machine's load hits every arm alike
            torch.set_num_threads(threads)
            fn()
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    pool.shutdown()
    torch.set_num_threads(1)
    base = statistics.median(times["per question, float32"])
    return {
        "shape": {"kv_heads": KV_HEADS, "group": GROUP, "head_dim": DIM, "keys": keys, "questions": q_count}
        | {"question_tokens": n},
        "median_ms": {name: statistics.median(v) for name, v in times.items()},
        "speedup_vs_per_question": {name: base / statistics.median(v) for name, v in times.items()},
        "ms": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1600, help="cached tokens the questions read (10 HotpotQA paragraphs)")
    ap.add_argument("--repeat", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--out", default=str(RESULTS / "batch_attention.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run(args.keys, args.repeat)
    for name, ms in res["median_ms"].items():
        logger.info("%-45s %7.1f ms  (%.2fx per question, float32)", name, ms, res["speedup_vs_per_question"][name])
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
