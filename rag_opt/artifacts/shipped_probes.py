"""The probe files shipped inside the package (``rag_opt/probes/``): finding one, and what its metadata says.

The scorer builds its probes from these files (:func:`rag_opt.compressors.probe.shipped_probe`); attention sorting
reads the retrieval heads that a document probe's training selected (:func:`retrieval_heads`, written by
:func:`rag_opt.training.doc_probe.select_retrieval_heads`) without building the probe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

__all__ = ["RetrievalHeads", "retrieval_heads", "shipped_probe_data", "shipped_probe_name"]


def shipped_probe_name(model: str, level: str = "unit", encoding: str = "joint") -> str:
    """The file name of the probe shipped for ``model`` (e.g. ``embedded:smollm2-135m``), ``level`` (``"unit"``: the
    sentence probe, ``"document"``: the document probe) and ``encoding`` (parallel probes are named
    ``<model>.parallel.json`` / ``<model>.parallel.doc.json``)."""
    suffix = {"unit": ".json", "document": ".doc.json"}[level]
    if encoding == "parallel":
        suffix = ".parallel" + suffix
    return model.replace(":", "-").replace("/", "-") + suffix


def shipped_probe_data(model: str, level: str = "unit", encoding: str = "joint") -> dict[str, Any] | None:
    """The JSON of the probe shipped for ``model``, ``level`` and ``encoding`` (see :func:`shipped_probe_name`), or
    None when none is shipped."""
    res = resources.files("rag_opt") / "probes" / shipped_probe_name(model, level, encoding)
    if not res.is_file():
        return None
    data: dict[str, Any] = json.loads(res.read_text())
    return data


@dataclass(frozen=True)
class RetrievalHeads:
    """The (layer, head) pairs whose attention ranks the answering document best, and the view they read
    (``"last"`` or ``"question"``): what :meth:`rag_opt.orderers.AttentionSort.tuned` averages."""

    view: str
    head_pairs: tuple[tuple[int, int], ...]


def retrieval_heads(model: str) -> RetrievalHeads | None:
    """The retrieval heads selected for ``model`` on NQ training questions, shipped in the metadata of its document
    probe (joint encoding), or None when there are none."""
    data = shipped_probe_data(model, "document")
    cfg = ((data.get("metadata") or {}).get("attention_sort") if data is not None else None) or {}
    if not cfg:
        return None
    return RetrievalHeads(view=str(cfg["view"]), head_pairs=tuple((int(a), int(b)) for a, b in cfg["head_pairs"]))
