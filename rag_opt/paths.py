"""Where rag-opt keeps its on-disk cache (converted models, calibration profiles, feature caches)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Root of rag-opt's on-disk cache (``RAG_OPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/rag-opt``)."""
    env = os.environ.get("RAG_OPT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rag-opt"
