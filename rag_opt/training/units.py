"""Training and benchmark data as unit lists and unit tables, rendered exactly as the optimizer renders them.

A HotpotQA question's paragraphs can be given in three *title regimes*, as users give their documents:

* ``field``: a title field. The optimizer puts a title row (``title + "\\n"``, not a candidate) before the text.
* ``text``: the title as the text's first line. The optimizer reads it as a leading heading line: a ``heading``
  unit of the text, not a candidate, with the same text as the title row. The proxy therefore reads the same
  tokens as under ``field``, and every feature is the same; only the unit's kind differs.
* ``none``: no title anywhere. Every unit is a sentence, and the document is linked by the subject its text opens
  with (:func:`rag_opt.text.titles.leading_subject`), as the optimizer links an untitled document.

Under ``field`` and ``text`` a paragraph is also linked, where salient, by the subject its text opens with when that
is not its title (:func:`rag_opt.text.name_variants.subject_names`), as the optimizer links a titled document.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

from rag_opt.errors import InvalidInputError
from rag_opt.text.name_variants import name_variants, opening_name, subject_names
from rag_opt.text.segment import segment
from rag_opt.text.titles import leading_subject
from rag_opt.text.units import UnitTable
from rag_opt.training.datasets import HotpotExample

__all__ = [
    "TITLE_REGIMES",
    "assign_title_regimes",
    "hotpot_table",
    "hotpot_units",
    "parse_title_mix",
    "regime_units",
    "titled_units",
]

TITLE_REGIMES = ("field", "text", "none")


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


def regime_units(ex: HotpotExample, regime: str) -> list[list[str]]:
    """The unit lists the proxy reads for ``ex`` given in title ``regime``: :func:`hotpot_units` for ``field`` and
    ``text`` (the same tokens), the sentences alone for ``none``."""
    _check_regime(regime)
    return [list(s) for s in ex.sentences] if regime == "none" else hotpot_units(ex)


def hotpot_table(ex: HotpotExample, regime: str = "field") -> UnitTable:
    """The unit table of ``ex`` given in title ``regime`` (see the module docstring)."""
    _check_regime(regime)
    if regime == "none":
        table = UnitTable.from_texts(ex.sentences, [[True] * len(s) for s in ex.sentences])
        links = tuple(leading_subject(ex.paragraph_text(p)) for p in range(len(ex.sentences)))
        variants = tuple(name_variants(s, ex.paragraph_text(p)) if s else () for p, s in enumerate(links))
        opening = [None if s else opening_name(ex.paragraph_text(p)) for p, s in enumerate(links)]
        openings: tuple[tuple[str, ...], ...] = tuple((o,) if o else () for o in opening)
        return dataclasses.replace(table, link_names=links, link_variants=variants, link_spans=openings)
    table = UnitTable.titled(hotpot_units(ex))
    spans = tuple(subject_names(t, ex.paragraph_text(p)) for p, t in enumerate(ex.titles))
    if regime == "text":
        kinds = tuple("heading" if k == "title" else k for k in table.kind)
        return dataclasses.replace(table, kind=kinds, link_names=tuple(ex.titles), link_spans=spans)
    return dataclasses.replace(table, link_spans=spans)


def parse_title_mix(text: str) -> dict[str, float]:
    """``"field=0.6,none=0.4"`` -> ``{"field": 0.6, "none": 0.4}``: the share of training contexts given in each
    title regime. Shares must be non-negative and sum to 1 (within 1e-6)."""
    mix: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep:
            raise InvalidInputError(f"title mix entry {part!r} is not regime=share")
        _check_regime(name)
        if name in mix:
            raise InvalidInputError(f"title regime {name!r} given twice in {text!r}")
        try:
            share = float(value)
        except ValueError:
            raise InvalidInputError(f"title mix share {value!r} for {name!r} is not a number") from None
        if not 0.0 <= share <= 1.0:
            raise InvalidInputError(f"title mix share for {name!r} must be in [0, 1], got {share}")
        mix[name] = share
    if not mix:
        raise InvalidInputError("the title mix is empty: give e.g. field=0.6,none=0.4")
    if abs(sum(mix.values()) - 1.0) > 1e-6:
        raise InvalidInputError(f"title mix shares must sum to 1, got {sum(mix.values()):g} in {text!r}")
    return mix


def assign_title_regimes(n: int, mix: Mapping[str, float], seed: int = 0) -> list[str]:
    """A title regime for each of ``n`` training contexts: ``round(share * n)`` of each regime (the largest share
    takes the rounding rest), shuffled with ``seed``. The same ``n``, mix and seed give the same assignment."""
    for name in mix:
        _check_regime(name)
    counts = {name: round(share * n) for name, share in mix.items()}
    top = max(mix, key=lambda k: mix[k])
    counts[top] += n - sum(counts.values())
    out = [name for name in TITLE_REGIMES if name in counts for _ in range(counts[name])]
    random.Random(seed).shuffle(out)
    return out


def _check_regime(regime: str) -> None:
    if regime not in TITLE_REGIMES:
        raise InvalidInputError(f"unknown title regime {regime!r}; known: {', '.join(TITLE_REGIMES)}")
