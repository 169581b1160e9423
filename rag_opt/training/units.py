"""Training and benchmark data as unit lists, rendered exactly as the optimizer renders a titled document."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rag_opt.text.segment import segment
from rag_opt.training.datasets import HotpotExample

__all__ = ["hotpot_units", "titled_units"]


def titled_units(docs: Sequence[Mapping[str, str]], language: str = "en") -> list[list[str]]:
    """Passages with a ``title`` and a ``text`` as unit lists — ``[title line, segment, ...]`` — exactly as the
    optimizer renders a titled document."""
    out = []
    for d in docs:
        text = d["text"]
        out.append([f"{d['title']}\n", *(text[s.start : s.end] for s in segment(text, language))])
    return out


def hotpot_units(ex: HotpotExample) -> list[list[str]]:
    """A HotpotQA example's paragraphs as unit lists: ``[title line, sentence, sentence, ...]``."""
    return [[f"{title}\n", *sents] for title, sents in zip(ex.titles, ex.sentences, strict=True)]
