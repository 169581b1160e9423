"""Native memory of a long-running process: RSS over many requests with glibc's and oneDNN's defaults, and with
rag-opt's settings (:mod:`rag_opt.native_memory`), side by side.

    OMP_NUM_THREADS=1 python benchmarks/native_memory.py --questions 120   # → benchmarks/results/native_memory.json

Each arm runs in a process of its own: the library defaults (parallel encoding), the encoding cache off (so the
cache's bounded growth does not hide the rest), the first ``--questions`` HotpotQA dev questions of the seeded
shuffle (10 paragraphs each), one at a time, RSS read from ``/proc/self/status`` after every question. The two arms
run at the same time, one per core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

_WORKER = r"""
import json, os, sys
sys.path.insert(0, {bench!r})
from common import data_dir
if os.environ.get("RAG_OPT_NATIVE_MEMORY") != "default":
    from rag_opt.native_memory import tune_native_memory
    tune_native_memory()
from rag_opt.pipeline import ContextOptimizer
from rag_opt.training.datasets import read_hotpotqa

def rss():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) // 1024 for l in fh if l.startswith("VmRSS"))

opt = ContextOptimizer(threads=1, cache=None)
out = []
for ex in read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit={n}):
    docs = [{{"id": t, "title": t, "text": ex.paragraph_text(p)}} for p, t in enumerate(ex.titles)]
    opt.optimize(ex.question, docs, ratio=1 / 3)
    out.append(rss())
print(json.dumps(out))
"""


def run(args: argparse.Namespace) -> dict[str, Any]:
    code = _WORKER.format(bench=str(Path(__file__).resolve().parent), n=args.questions)
    arms = {"defaults": {"RAG_OPT_NATIVE_MEMORY": "default"}, "rag-opt settings": {}}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "OMP_NUM_THREADS": "1", **extra},
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, extra in arms.items()
    }
    series = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"the {name} arm failed (exit {proc.returncode})")
        series[name] = json.loads(stdout.strip().splitlines()[-1])
    return {"questions": args.questions, "rss_mib": series}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=120)
    ap.add_argument("--out", default=str(RESULTS / "native_memory.json"))
    args = ap.parse_args()
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    n = res["questions"]
    marks = [m for m in (1, 20, 40, 80, 120, 200, n) if m <= n]
    print("RSS MiB after question   " + "  ".join(f"{m:>5}" for m in dict.fromkeys(marks)))
    for name, values in res["rss_mib"].items():
        print(f"{name:<24} " + "  ".join(f"{values[m - 1]:>5}" for m in dict.fromkeys(marks)))


if __name__ == "__main__":
    main()
