"""Text handling: segmentation into units with character offsets, target-LLM token counting, the unit table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt._lazy import lazy_module

__all__ = ["Segment", "TokenCounter", "UnitTable", "get_token_counter", "segment"]

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.text.segment import Segment, segment
    from rag_opt.text.tokens import TokenCounter, get_token_counter
    from rag_opt.text.units import UnitTable

__getattr__, __dir__ = lazy_module(
    __name__,
    {
        "Segment": "rag_opt.text.segment",
        "segment": "rag_opt.text.segment",
        "TokenCounter": "rag_opt.text.tokens",
        "get_token_counter": "rag_opt.text.tokens",
        "UnitTable": "rag_opt.text.units",
    },
)
