"""Latency, quality and memory of rag-opt configurations, measured side by side in one run.

Each configuration (precision, depth, threads, tier) runs in its own worker process, so its model, threads and
peak RSS are its own. Questions are interleaved: every question goes to every configuration before the next
question, in a rotating order, so machine noise hits them all alike. Only one worker computes at a time.

Per configuration: median and p90 optimize latency per question (10 HotpotQA dev paragraphs), quality at a
budget of 1/3 in o200k tokens (supporting-fact recall, all facts kept, answer kept, as in
``benchmarks/compression.py``), peak RSS, and ratios to the first configuration (the baseline).
``--contention N`` runs N busy-looping processes during the run (bounded by the run), to show how the thread
choices behave on a shared CPU.

    python benchmarks/latency.py --questions 40                        # the default configurations
    python benchmarks/latency.py --questions 40 --contention 1 --configs fp32-t1,fp32-t2,fp32-auto
    python benchmarks/latency.py --probe-dir DIR                       # + early exit with DIR/sentence-L{K}.json

Results: ``benchmarks/results/latency.json`` and ``latency.png`` (quality vs latency).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass(frozen=True)
class Config:
    name: str
    dtype: str = "float32"
    threads: str = "1"  # "1", "2" or "auto"
    probe: str = "auto"  # a sentence probe path (its depth sets the early exit) or "auto" (shipped)
    doc_probe: str = "auto"
    tier: str = "model"
    batch: int = 1  # >1: questions go through optimize_batch in groups of this size
    encoding: str | None = None  # how the proxy reads the context (None: the library's default, parallel)


def default_configs(probe_dir: str | None) -> list[Config]:
    configs = [
        Config("fp32-t1"),
        Config("fp32-t2", threads="2"),
        Config("bf16-t1", dtype="bfloat16"),
        Config("bf16-joint-t1", dtype="bfloat16", encoding="joint"),  # the previous default's reading
        Config("bf16-t2", dtype="bfloat16", threads="2"),
        Config("bf16-auto", dtype="bfloat16", threads="auto"),
        Config("bf16-adaptive", dtype="bfloat16", threads="adaptive"),
        Config("int8-t1", dtype="int8"),
        Config("lexical", tier="lexical"),
    ]
    if probe_dir:
        for path in sorted(Path(probe_dir).glob("sentence-L*.json")):
            k = path.stem.split("-L")[-1]
            doc = Path(probe_dir) / f"doc-L{k}.json"
            doc_probe = str(doc) if doc.is_file() else "auto"  # read only by orderings that use document relevance
            for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
                configs.append(Config(f"{short}-L{k}-t1", dtype=dtype, probe=str(path), doc_probe=doc_probe))
    return configs


def _worker(cfg: Config, conn: Any) -> None:
    import resource

    from rag_opt.pipeline import ContextOptimizer

    threads: int | str = int(cfg.threads) if cfg.threads.isdigit() else cfg.threads
    opt = ContextOptimizer(
        dtype=cfg.dtype,
        probe=cfg.probe,
        doc_probe=None if cfg.doc_probe == "none" else cfg.doc_probe,
        tier=cfg.tier,
        threads=threads,
        **({"encoding": cfg.encoding} if cfg.encoding else {}),
    )
    if cfg.tier == "model":
        opt.scorer()  # load before timing
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        questions, docs = msg
        t = time.perf_counter()
        if cfg.batch > 1:
            results = opt.optimize_batch(questions, docs, ratio=1 / 3)
        else:
            results = [opt.optimize(q, d, ratio=1 / 3) for q, d in zip(questions, docs, strict=True)]
        ms = (time.perf_counter() - t) * 1e3
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
        conn.send((ms, [r.model_dump_json() for r in results], rss))


def _start_workers(ctx: Any, configs: list[Config]) -> list[tuple[Config, Any, Any]]:
    """One process per configuration, each with its model loaded (``ready``) before any timing starts."""
    workers = []
    for cfg in configs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(cfg, child), daemon=True)
        proc.start()
        workers.append((cfg, parent, proc))
    for cfg, conn, _ in workers:
        if conn.recv() != "ready":
            raise SystemExit(f"worker {cfg.name} failed to start")
    return workers


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common import data_dir
    from compression import hotpot_metrics, summarize
    from tqdm.auto import tqdm

    from rag_opt.training.datasets import read_hotpotqa
    from rag_opt.types import OptimizeResult

    configs = default_configs(args.probe_dir)
    if args.configs:
        wanted = args.configs.split(",")
        configs = [c for c in configs if c.name in wanted]
        missing = set(wanted) - {c.name for c in configs}
        if missing:
            raise SystemExit(f"unknown configuration(s) {sorted(missing)}")
    examples = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.offset + args.questions)
    examples = examples[args.offset :]
    ctx = mp.get_context("spawn")
    workers = _start_workers(ctx, configs)
    busy = [ctx.Process(target=_busy, args=(24 * 3600,), daemon=True) for _ in range(args.contention)]
    for b in busy:
        b.start()
    lat: dict[str, list[float]] = {c.name: [] for c in configs}
    rows: dict[str, list[dict[str, float | None]]] = {c.name: [] for c in configs}
    rss: dict[str, float] = {}
    try:
        for i, ex in enumerate(tqdm(examples, desc="questions (every configuration)")):
            docs = [{"id": t, "title": t, "text": ex.paragraph_text(p)} for p, t in enumerate(ex.titles)]
            for k in range(len(workers)):
                cfg, conn, _ = workers[(i + k) % len(workers)]
                conn.send(([ex.question], [docs]))
                ms, results, peak = conn.recv()
                lat[cfg.name].append(ms)
                rss[cfg.name] = peak
                rows[cfg.name].append(hotpot_metrics(ex, OptimizeResult.model_validate_json(results[0])))
    finally:
        for b in busy:
            b.terminate()
        for _, conn, proc in workers:
            conn.send(None)
            proc.join(timeout=30)
    base = configs[0].name
    base_med = statistics.median(lat[base])
    table = {}
    for cfg in configs:
        xs = sorted(lat[cfg.name])
        q = summarize(rows[cfg.name])
        table[cfg.name] = {
            "config": asdict(cfg),
            "median_ms": statistics.median(xs),
            "p90_ms": xs[min(len(xs) - 1, int(0.9 * len(xs)))],
            "latency_ratio_to_baseline": statistics.median(xs) / base_med,
            "peak_rss_mib": rss.get(cfg.name),
            **q,
        }
    return {
        "questions": len(examples),
        "offset": args.offset,
        "baseline": base,
        "contention_processes": args.contention,
        "cores": os.cpu_count(),
        "configs": table,
    }


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """``optimize_batch`` of N questions against N single calls, same precision and threads, interleaved
    ``--rounds`` times (each round: both, alternating which goes first)."""
    from common import data_dir

    from rag_opt.training.datasets import read_hotpotqa

    examples = read_hotpotqa(data_dir() / "hotpotqa" / "dev.jsonl.gz", seed=0, limit=args.throughput)
    questions = [ex.question for ex in examples]
    docs = [[{"id": t, "title": t, "text": ex.paragraph_text(p)} for p, t in enumerate(ex.titles)] for ex in examples]
    dtype = args.dtype
    configs = [
        Config(f"single-{dtype}", dtype=dtype),
        Config(f"batch{len(examples)}-{dtype}", dtype=dtype, batch=len(examples)),
    ]
    ctx = mp.get_context("spawn")
    workers = _start_workers(ctx, configs)
    seconds: dict[str, list[float]] = {c.name: [] for c in configs}
    same = True
    try:
        for r in range(args.rounds):
            outputs = {}
            for k in range(2):
                cfg, conn, _ = workers[(r + k) % 2]
                conn.send((questions, docs))
                ms, results, _ = conn.recv()
                seconds[cfg.name].append(ms / 1e3)
                outputs[cfg.name] = [json.loads(x)["documents"] for x in results]
            a, b = outputs.values()
            kept = lambda out: [[d["kept_spans"] for d in docs_] for docs_ in out]  # noqa: E731
            same = same and kept(a) == kept(b)
    finally:
        for _, conn, proc in workers:
            conn.send(None)
            proc.join(timeout=30)
    med = {name: statistics.median(v) for name, v in seconds.items()}
    single, batch = (c.name for c in configs)
    return {
        "questions": len(examples),
        "rounds": args.rounds,
        "median_seconds": med,
        "questions_per_second": {n: len(examples) / v for n, v in med.items()},
        "batch_speedup": med[single] / med[batch],
        "same_kept_spans": same,
    }


def print_table(res: dict[str, Any]) -> None:
    print(
        f"{res['questions']} HotpotQA dev questions, budget 1/3 (o200k), {res['contention_processes']} busy "
        f"process(es) competing, baseline {res['baseline']}"
    )
    cols = ("median ms", 10), ("p90 ms", 9), ("× base", 8), ("SF rec", 8), ("all SF", 8), ("ans", 7), ("RSS MiB", 9)
    print(f"{'configuration':<16}" + "".join(f"{c:>{w}}" for c, w in cols))
    for name, r in res["configs"].items():
        print(
            f"{name:<16}{r['median_ms']:>10.0f}{r['p90_ms']:>9.0f}{r['latency_ratio_to_baseline']:>8.2f}"
            f"{r['sf_recall']:>8.3f}{r['all_facts_kept']:>8.3f}{r['answer_retention']:>7.3f}"
            f"{r['peak_rss_mib'] or 0:>9.0f}"
        )


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in res["configs"].items():
        ax.scatter(r["median_ms"], r["sf_recall"], s=40)
        ax.annotate(name, (r["median_ms"], r["sf_recall"]), fontsize=8, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("median optimize latency per question (ms, log scale)")
    ax.set_ylabel("supporting-fact recall at 1/3")
    ax.set_title(f"Quality vs latency, {res['questions']} HotpotQA dev questions")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--offset", type=int, default=0, help="skip this many questions of the (seeded) dev order first")
    ap.add_argument("--configs", default=None, help="comma-separated configuration names (default: all)")
    ap.add_argument("--probe-dir", default=None, help="folder of per-depth probes sentence-L{K}.json [doc-L{K}.json]")
    ap.add_argument("--contention", type=int, default=0, help="busy processes competing during the run")
    ap.add_argument("--out", default=str(RESULTS / "latency"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--throughput", type=int, default=0, help="N: optimize_batch of N questions vs N single calls")
    ap.add_argument("--rounds", type=int, default=2, help="with --throughput: interleaved rounds")
    ap.add_argument("--dtype", default="float32", help="with --throughput: the precision")
    args = ap.parse_args()
    if args.throughput:
        res_t = run_throughput(args)
        print(json.dumps(res_t, indent=2))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).with_suffix(".throughput.json").write_text(json.dumps(res_t, indent=2))
        return
    out = Path(args.out)
    from common import data_dir

    if not args.report_only and not (data_dir() / "hotpotqa" / "dev.jsonl.gz").is_file():
        raise SystemExit(f"real data not found under {data_dir()}: this benchmark needs ../shared/data")
    res = json.loads(out.with_suffix(".json").read_text()) if args.report_only else run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))
    print_table(res)


if __name__ == "__main__":
    main()
