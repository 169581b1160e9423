"""What an optimize result says about itself when it is not what one might assume: why nothing was compressed,
and how its scores were made (``OptimizeResult.warnings``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.base import Scores
    from rag_opt.orderers.base import Orderer
    from rag_opt.types import Budget

__all__ = ["score_warnings", "uncompressed_note"]


def uncompressed_note(budget: Budget, limit: int | None, tokens_before: int) -> str:
    """Why nothing was compressed (never a silent no-op)."""
    if not budget.compresses:
        return "nothing compressed: no budget was set"
    given = (
        f"ratio {budget.ratio:g}"
        if budget.ratio is not None
        else f"target_tokens {budget.target_tokens}"
        if budget.target_tokens is not None
        else "the budget"
    )
    return (
        f"nothing compressed: the budget ({given}: {limit} tokens) holds the whole context ({tokens_before} target "
        "tokens)"
    )


def score_warnings(scores: Scores, orderer: Orderer) -> list[str]:
    """What a result says about how its scores were made: no position calibration, no probe."""
    out = [scores.calibration_note] if scores.calibration_note and orderer.reorders else []
    if scores.method == "raw-attention":
        out.append(f"no probe for proxy model {scores.model}: sentences were scored by raw attention (weaker)")
    return out
