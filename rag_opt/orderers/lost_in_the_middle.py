"""End placement of retrieved documents against the "lost in the middle" effect.

Liu et al. (2023), *Lost in the Middle: How Language Models Use Long Contexts*, found that
LLMs use information at the start and at the end of a long context far better than
information in the middle.  End placement exploits that: the most relevant documents go to
the two ends of the context and the least relevant ones end up in the middle.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import ClassVar, Literal

from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.orderers.base import OrdererResources, Ordering, OrderItem, register_orderer

__all__ = ["LostInTheMiddle", "checked_scores", "end_placement", "rank_scores"]

_BEST_CHOICES: tuple[str, ...] = ("first", "last")


def _check_best(best: object) -> None:
    if not isinstance(best, str) or best not in _BEST_CHOICES:
        raise InvalidInputError(f"best must be 'first' or 'last', got {best!r}")


def checked_scores(scores: Sequence[float]) -> list[float]:
    """Return ``scores`` as a list, raising if any entry is not a finite real number."""
    if isinstance(scores, (str, bytes)):
        raise InvalidInputTypeError(f"scores must be a sequence of numbers, got {type(scores).__name__}")
    values = list(scores)
    for i, s in enumerate(values):
        if isinstance(s, bool) or not isinstance(s, numbers.Real):
            raise InvalidInputTypeError(f"scores[{i}] must be a real number, got {type(s).__name__}: {s!r}")
        try:
            finite = math.isfinite(s)
        except OverflowError:  # an int too large for a float is still finite
            finite = True
        if not finite:
            raise InvalidInputError(f"scores[{i}] must be finite, got {s!r}")
    return values


def rank_scores(n: int) -> list[float]:
    """Scores that rank ``n`` documents by their input order (index 0 is the most relevant).

    Use it when the retriever already returns documents best first and no scores are at hand:
    ``end_placement(rank_scores(len(docs)))``.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise InvalidInputTypeError(f"n must be an int, got {type(n).__name__}: {n!r}")
    if n < 0:
        raise InvalidInputError(f"n must be >= 0, got {n}")
    return [float(-i) for i in range(int(n))]


def end_placement(scores: Sequence[float], *, best: Literal["first", "last"] = "first") -> list[int]:
    """Permutation that puts the most relevant documents at the ends, the least in the middle.

    Documents are ranked by score, highest first; equal scores keep their input order (the
    earlier input ranks better).  The best document goes to slot 0 (``best="first"``) or to the
    last slot (``best="last"``), the 2nd best to the opposite end, the 3rd best next to the
    best, the 4th next to the 2nd, and so on, filling the context from both ends toward the
    middle.  For ``N`` documents and rank ``k`` (0-based) with ``best="first"``, the slot is
    ``k // 2`` for even ``k`` and ``N - 1 - k // 2`` for odd ``k``; ``best="last"`` mirrors it.

    This holds for odd and even ``N`` alike.  LangChain's ``LongContextReorder`` alternates by
    the parity of the position, so it puts the best document last for even counts and first
    for odd counts; this function always honours ``best``.

    Args:
        scores: One relevance score per document, higher is more relevant.  Must be finite.
        best: The end of the context that receives the single most relevant document.

    Returns:
        ``perm`` such that output slot ``i`` holds input document ``perm[i]``, i.e. the
        reordered documents are ``[docs[j] for j in perm]``.

    Raises:
        ValueError: a score is NaN or infinite (the message names its index), or ``best`` is
            neither ``"first"`` nor ``"last"``.
        TypeError: a score is not a real number.

    Example:
        >>> end_placement([4, 3, 2, 1])
        [0, 2, 3, 1]
        >>> end_placement([4, 3, 2, 1], best="last")
        [1, 3, 2, 0]
    """
    _check_best(best)
    values = checked_scores(scores)
    n = len(values)
    ranked = sorted(range(n), key=lambda i: (-values[i], i))
    perm = [0] * n
    for k, idx in enumerate(ranked):
        slot = k // 2 if k % 2 == 0 else n - 1 - k // 2
        if best == "last":
            slot = n - 1 - slot
        perm[slot] = idx
    return perm


@register_orderer
class LostInTheMiddle:
    """End placement against "lost in the middle" (Liu et al. 2023).

    Puts the most relevant documents at the two ends of the context, where LLMs attend best,
    and the least relevant in the middle.  The best document goes first (``best="first"``) or
    last (``best="last"``) for any number of documents; the 2nd best goes to the other end.
    Unlike LangChain's ``LongContextReorder``, the end chosen for the best document does not
    depend on whether the document count is odd or even.  See :func:`end_placement`.
    """

    name: ClassVar[str] = "lost_in_the_middle"
    reorders: ClassVar[bool] = True

    def __init__(self, best: Literal["first", "last"] = "first") -> None:
        _check_best(best)
        self.best: Literal["first", "last"] = best

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> LostInTheMiddle:
        return cls()

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering:
        """End placement by relevance: output slot ``i`` holds input document ``permutation[i]``."""
        return Ordering(end_placement([d.relevance for d in documents], best=self.best))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(best={self.best!r})"
