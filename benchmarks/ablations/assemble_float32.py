"""A warm question pass with its cached states assembled in float32 against converted per layer, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/ablations/assemble_float32.py --rounds 6   # → results/assemble_float32.json

The question attention reads keys and values in float32. In bfloat16 a one-row pass used to convert its row's
cached states once per layer and question; now the buffer they are copied into is float32 (converted once while
copied; :data:`rag_opt.models.question_buffer.ASSEMBLE_ONE_ROW_IN_FLOAT32`). Sixteen warm single calls over one cached
HotpotQA document set (dev, seeded shuffle) run with each setting in rotating order; reported: the time of each
round, the median ratio new / old, and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py and its siblings
from common import data_dir  # noqa: E402

from rag_opt.models import question_buffer  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.training.datasets import read_hotpotqa  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "assemble_float32.json"))
    args = ap.parse_args()
    pool = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.questions + 1)
    docs = [{"id": str(p), "title": t, "text": pool[0].paragraph_text(p)} for p, t in enumerate(pool[0].titles)]
    questions = [ex.question for ex in pool[1:]]
    opt = ContextOptimizer(threads=args.threads)
    opt.optimize(pool[0].question, docs)  # caches the documents
    proxy = opt._proxy_for("relevance")
    import torch

    if proxy.dtype != torch.bfloat16:
        print(f"the proxy runs in {proxy.dtype}: its states are float32 already, nothing to compare")
        return
    times: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list[str]] = {}
    for r in range(args.rounds):
        for flag in (True, False) if r % 2 else (False, True):
            question_buffer.ASSEMBLE_ONE_ROW_IN_FLOAT32 = flag
            question_buffer.forget(proxy)
            t = time.perf_counter()
            res = [opt.optimize(q, docs) for q in questions]
            times[flag].append(time.perf_counter() - t)
            outputs[flag] = [x.context() for x in res]
    question_buffer.ASSEMBLE_ONE_ROW_IN_FLOAT32 = True
    out = {
        "questions": len(questions),
        "float32_s": times[True],
        "per_layer_s": times[False],
        "ratio_median": statistics.median(a / b for a, b in zip(times[True], times[False], strict=True)),
        "identical_outputs": outputs[True] == outputs[False],
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"{len(questions)} warm calls: float32 buffer {statistics.median(times[True]):.2f} s, per-layer conversion "
        f"{statistics.median(times[False]):.2f} s (medians of {args.rounds}); median ratio {out['ratio_median']:.3f}; "
        f"identical outputs: {out['identical_outputs']}"
    )


if __name__ == "__main__":
    main()
