"""Checking what ``optimize`` is given: the query, the documents, the budget and the tier, with clear errors."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence

from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.types import TIERS, Budget, Document, DocumentLike, Tier, to_documents

__all__ = ["check_budget", "check_documents", "check_query", "check_share", "check_tier", "has_lone_surrogate"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(value: object) -> bool:
    """Whether ``value`` (a string, or parsed JSON: lists, dicts and their keys, at any depth) holds a UTF-16
    surrogate on its own, as a ``\\ud800``-style JSON escape without its pair leaves: not Unicode text, it cannot
    be encoded as UTF-8."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return False


def check_budget(
    ratio: float | None, target_tokens: int | None, threshold: float | None, budget: Budget | None
) -> Budget | None:
    """The budget given as keywords or as a :class:`Budget` (not both); None when neither is given."""
    loose = Budget(ratio=ratio, target_tokens=target_tokens, threshold=threshold)
    if budget is not None:
        if not isinstance(budget, Budget):
            raise InvalidInputTypeError(f"budget must be a rag_opt.Budget, got {type(budget).__name__}")
        if loose.compresses:
            raise InvalidInputError("give the budget either as ratio/target_tokens/threshold or as budget=, not both")
        return budget
    return loose if loose.compresses else None


def check_share(name: str, value: object) -> float | None:
    """A share in (0, 1] (None passes through), or a clear error naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInputTypeError(f"{name} must be a number in (0, 1], got {type(value).__name__}: {value!r}")
    share = float(value)
    if not math.isfinite(share) or not 0 < share <= 1:
        raise InvalidInputError(f"{name} must be in (0, 1], got {value!r}")
    return share


def check_tier(tier: object) -> Tier:
    if tier not in TIERS:
        raise InvalidInputError(f"unknown tier {tier!r}; use one of {', '.join(TIERS)}")
    return tier  # type: ignore[return-value]


def check_query(query: object) -> str:
    if not isinstance(query, str):
        raise InvalidInputTypeError(f"query must be a string, got {type(query).__name__}")
    if not query.strip():
        raise InvalidInputError("query is empty")
    return query


def check_documents(documents: Sequence[DocumentLike]) -> list[Document]:
    docs = to_documents(documents)
    for i, doc in enumerate(docs):
        if not doc.text.strip():
            raise InvalidInputError(f"documents[{i}] is empty: every document needs some text")
    return docs
