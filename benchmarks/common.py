"""What the benchmarks share: where the real data lives (``$RAG_OPT_DATA_DIR``, else ../shared/data)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
