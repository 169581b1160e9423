"""The target-tokenizer cache under names a client chooses (issue 21, defects 3 and 4).

    python benchmarks/ablations/tokenizer_cache.py  # → benchmarks/results/tokenizer_cache.json (~1 minute)
    python benchmarks/ablations/tokenizer_cache.py --report-only    # show the saved results

In one process, side by side:

* **memory**: the RSS growth after ``--spellings`` spellings of one Hugging Face tokenizer folder (``hf:DIR``,
  ``hf:DIR/``, ``hf:DIR/./``, ``hf:DIR/../NAME``, ...; the embedded SmolLM2's tokenizer, copied to a temporary
  folder) and after ``--names`` unique 1 MB model names, through ``get_token_counter`` and through the baseline:
  the cache as it was before (``functools.cache`` keyed by the raw name, each spelling loaded on its own);
* **stall**: how long a first ``cl100k_base`` request waits while another name's load hangs (a hub that does not
  answer, simulated for ``--hang-s`` seconds), through ``get_token_counter`` (no lock across a load) and through
  the baseline (one lock held across every load).

The ratios are the result; nothing here is a pass/fail bound.
"""

from __future__ import annotations

import argparse
import functools
import gc
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import run_or_report

from rag_opt.text import tokens

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def tokenizer_folder(dest: Path, source: Path | None) -> Path:
    """A copy of a real Hugging Face tokenizer's files (default: the embedded proxy model's, as rag-opt keeps it in
    its cache once the model has loaded)."""
    if source is None:
        from rag_opt.paths import cache_dir

        found = sorted((cache_dir() / "models").glob("*/tokenizer.json"))
        if not found:
            raise SystemExit("no tokenizer found: load the proxy model once (rag-opt optimize ...) or pass --folder")
        source = found[0].parent
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, dest / name)
    return dest


def spellings(folder: Path, n: int) -> list[str]:
    """``n`` different names of one folder: hf:DIR, hf:DIR/../NAME, hf:DIR/, hf:DIR/./., hf:DIR/././., ..."""
    out = [f"hf:{folder}" + "/." * i for i in range(n)]
    out[1 % n] = f"hf:{folder}/../{folder.name}"
    out[2 % n] = f"hf:{folder}/"
    return out


def memory(counter: Any, names: list[str]) -> float:
    gc.collect()
    before = rss_mb()
    kept = [counter(name) for name in names]
    gc.collect()
    grown = rss_mb() - before
    del kept
    return grown


def stall(counter: Any, hang_s: float) -> float:
    """Milliseconds a cl100k_base request took while another name's load hung for ``hang_s``."""
    started = threading.Event()
    build = tokens._build_counter

    def hanging(key: str) -> Any:
        if key.startswith("hf:"):
            started.set()
            time.sleep(hang_s)
            raise ValueError("the hub did not answer")
        return build(key)

    tokens._build_counter = hanging
    try:
        slow = threading.Thread(target=lambda: _quietly(counter, "hf:org/unreachable"))
        slow.start()
        started.wait()
        t0 = time.perf_counter()
        counter("cl100k_base")
        waited = (time.perf_counter() - t0) * 1e3
        slow.join()
    finally:
        tokens._build_counter = build
    return waited


def _quietly(counter: Any, name: str) -> None:
    try:
        counter(name)
    except ValueError:
        pass


def baseline() -> Any:
    """The cache before the fix: every raw name its own entry, one global lock held across each load."""
    lock = threading.Lock()

    @functools.cache
    def get(target: str | None = None) -> Any:
        with lock:
            name = (target or "").strip()
            if name.startswith(tokens.HF_PREFIX):
                return tokens._build_counter(name)
            return tokens.TiktokenCounter(tokens.load_encoding(tokens.resolve_encoding_name(name)), target=name)

    return get


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = tokenizer_folder(Path(tmp) / "tok", args.folder)
        hf_names = spellings(folder, args.spellings)
        long_names = [f"model-{i}-" + "x" * 2**20 for i in range(args.names)]
        res: dict[str, Any] = {"spellings": args.spellings, "names": args.names, "hang_s": args.hang_s}
        for label, make in (("baseline", baseline), ("fixed", tokens.TokenCounterCache)):
            counter = make()
            res[label] = {
                "hf_spellings_mb": round(memory(counter, hf_names), 1),
                "unique_1mb_names_mb": round(memory(counter, long_names), 1),
                "entries": counter.cache_info().currsize,
            }
            res[label]["cl100k_wait_ms"] = round(stall(make(), args.hang_s), 2)
    # ratios over at least 1 MB / 1 ms: a few hundred kB or a fraction of a millisecond is noise here
    for key in ("hf_spellings_mb", "unique_1mb_names_mb", "cl100k_wait_ms"):
        fixed = max(res["fixed"][key], 1.0)
        res.setdefault("ratio_baseline_over_fixed", {})[key] = round(res["baseline"][key] / fixed, 1)
    return res


def show(res: dict[str, Any]) -> None:
    print(
        f"{res['spellings']} spellings of one hf: folder, {res['names']} unique 1 MB names, "
        f"a load hanging {res['hang_s']} s (ratios over at least 1 MB / 1 ms)"
    )
    print(f"{'':24}{'baseline':>12}{'fixed':>12}{'ratio':>10}")
    for key, label in (
        ("hf_spellings_mb", "RSS +MB, spellings"),
        ("unique_1mb_names_mb", "RSS +MB, 1 MB names"),
        ("cl100k_wait_ms", "cl100k wait, ms"),
    ):
        b, f = res["baseline"][key], res["fixed"][key]
        print(f"{label:24}{b:>12}{f:>12}{res['ratio_baseline_over_fixed'][key]:>10}")
    print(f"{'cache entries':24}{res['baseline']['entries']:>12}{res['fixed']['entries']:>12}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", type=Path, help="a Hugging Face tokenizer folder (default: the embedded model's)")
    p.add_argument("--spellings", type=int, default=30)
    p.add_argument("--names", type=int, default=30)
    p.add_argument("--hang-s", type=float, default=3.0)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    run_or_report(RESULTS / "tokenizer_cache.json", args.report_only, lambda: run(args), show)


if __name__ == "__main__":
    main()
