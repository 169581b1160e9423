"""What the benchmarks share: where the real data lives (``$RAG_OPT_DATA_DIR``, else ../shared/data), saving a
run, and paired differences with bootstrap intervals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rag_opt.training.datasets import data_dir as _data_dir

ROOT = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    """The data folder: ``$RAG_OPT_DATA_DIR``, else ``../shared/data`` next to this checkout."""
    return _data_dir(ROOT.parent / "shared" / "data")


def run_or_report(
    out: Path, report_only: bool, run: Callable[[], dict[str, Any]], show: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Run a benchmark and save its JSON at ``out`` (or, ``report_only``, read the saved one), then show it."""
    res = json.loads(out.read_text()) if report_only else run()
    if not report_only:
        out.write_text(json.dumps(res, indent=1))
    show(res)
    return res


def paired_bootstrap(a: list[float | None], b: list[float | None], *, draws: int = 10_000, seed: int = 0) -> dict:
    """Mean of ``b - a`` over the questions where both are defined, with a 95 % percentile interval."""
    pairs = np.array([(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None], dtype=float)
    if not len(pairs):
        return {"diff": None, "low": None, "high": None, "n": 0}
    d = pairs[:, 1] - pairs[:, 0]
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(draws, len(d)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"diff": float(d.mean()), "low": float(low), "high": float(high), "n": len(d)}
