"""What an optimize result says about itself when it is not what one might assume: why nothing was compressed,
how its scores were made, and that the shipped probes read English (``OptimizeResult.warnings``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_opt.text.language import base_language

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.base import Scores
    from rag_opt.orderers.base import Orderer
    from rag_opt.types import Budget

__all__ = ["language_note", "score_warnings", "uncompressed_note"]


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


def language_note(language: str) -> str | None:
    """What a result scored by a shipped probe says when its documents are not English (None when they are): the
    shipped probes (sentence, document and lexical) were trained on English questions and passages only."""
    if base_language(language) == "en":
        return None
    return (
        f"language {language!r}: the shipped probes were trained on English (HotpotQA and NQ), so relevance, and "
        "with it what is kept and the order, may be less accurate for this language (a probe trained on data in "
        "your language: rag-opt train-probe, then probe=<its JSON>)"
    )
