"""Artifacts the runtime reads, a floor below the stages that read them: position profiles and the shipped probes.

Both the scorer (:mod:`rag_opt.compressors`) and the orderers (:mod:`rag_opt.orderers`) read them, so they live
here and neither of those packages imports the other for them. Nothing here loads a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = ["PositionProfile", "ProfileStore", "RetrievalHeads", "retrieval_heads", "shipped_probe_data"]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.artifacts.position_profiles import PositionProfile, ProfileStore
    from rag_opt.artifacts.shipped_probes import RetrievalHeads, retrieval_heads, shipped_probe_data

__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "PositionProfile": "rag_opt.artifacts.position_profiles",
        "ProfileStore": "rag_opt.artifacts.position_profiles",
        "RetrievalHeads": "rag_opt.artifacts.shipped_probes",
        "retrieval_heads": "rag_opt.artifacts.shipped_probes",
        "shipped_probe_data": "rag_opt.artifacts.shipped_probes",
    },
)
