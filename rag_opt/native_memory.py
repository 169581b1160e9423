"""Keeping a long-running process's native memory flat: glibc's allocator and oneDNN's primitive cache.

A process that serves many requests (``rag-opt serve``, ``rag-opt mcp``) allocates tensors of ever-changing sizes
(every context has its own length). With glibc's defaults, freed memory stays in the process (its mmap threshold
rises with the largest block freed, and freed heap is trimmed rarely), and oneDNN keeps a compiled kernel, with its
scratch memory, for each new shape (1,024 by default). Measured on 120 HotpotQA dev questions of 10 paragraphs, one
process, no encoding cache (``python benchmarks/native_memory.py``): RSS grows by hundreds of MiB and keeps growing
with the defaults, and levels off with these settings.

:func:`tune_native_memory` is called by the long-running commands at start-up, before the model loads; importing
rag-opt changes nothing. Set ``RAG_OPT_NATIVE_MEMORY=default`` to leave the process as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MMAP_THRESHOLD", "ONEDNN_CACHE_CAPACITY", "tune_native_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 64 * 1024  # blocks this large are mmapped, so freeing them returns them to the system
ONEDNN_CACHE_CAPACITY = 8  # compiled oneDNN kernels kept (each new shape compiles one; rebuilding costs little)
_M_TRIM_THRESHOLD = -1  # glibc mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_native_memory() -> dict[str, object]:
    """Apply the settings (where they apply: glibc for the allocator; oneDNN reads its variable when it starts, so
    call this before the first forward pass); returns what was set."""
    if os.environ.get("RAG_OPT_NATIVE_MEMORY", "").lower() == "default":
        return {}
    applied: dict[str, object] = {}
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(ONEDNN_CACHE_CAPACITY)
        applied["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = ONEDNN_CACHE_CAPACITY
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        for param, value, label in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD, "mmap_threshold"),
            (_M_TRIM_THRESHOLD, 0, "trim_threshold"),
            (_M_ARENA_MAX, 2, "arena_max"),
        ):
            if mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1:
                applied[label] = value
    logger.debug("native memory settings: %s", applied)
    return applied
