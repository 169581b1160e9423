"""What the benchmarks share: where the real data lives (``$RAG_OPT_DATA_DIR``, else ../shared/data)."""

from __future__ import annotations

from pathlib import Path

from rag_opt.training.datasets import data_dir as _data_dir

ROOT = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    """The data folder: ``$RAG_OPT_DATA_DIR``, else ``../shared/data`` next to this checkout."""
    return _data_dir(ROOT.parent / "shared" / "data")
