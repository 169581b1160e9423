"""The fields both contracts of ``POST /v1/compress`` take, each validated in one place: the budget's limits
(``ratio``, ``target_tokens``, ``threshold``), the document ``ordering`` and the ``language``. The documents
contract (:mod:`rag_opt.wire.compress_protocol`) and the messages contract
(:mod:`rag_opt.wire.compress_messages_protocol`) annotate their fields with these types."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from rag_opt.text.language import check_language
from rag_opt.types import OrderingName, check_ordering

__all__ = ["LanguageCode", "OrderingChoice", "Ratio", "TargetTokens", "Threshold"]

Ratio = Annotated[float | None, Field(gt=0, le=1, description="fraction of context tokens to keep")]
"""The budget as a fraction of the context's tokens (default ``None``: not this limit)."""

TargetTokens = Annotated[int | None, Field(ge=0, description="context tokens to keep (target tokenizer)")]
"""The budget in the target tokenizer's tokens (default ``None``: not this limit)."""

Threshold = Annotated[
    float | None, Field(ge=0, le=1, description="keep sentences whose relevance probability is at least this")
]
"""The budget as a relevance probability (default ``None``: not this limit)."""

LanguageCode = Annotated[str, AfterValidator(check_language)]
"""An ISO 639 code, normalized by :func:`~rag_opt.text.language.check_language` (``pt_BR`` → ``pt-br``)."""

OrderingChoice = Annotated[OrderingName, AfterValidator(check_ordering)]
"""A document ordering's name, checked by :func:`~rag_opt.types.check_ordering`."""
