"""What each unit needs kept with it (the select stage's dependencies): its document's title row, the nearest
heading before it, the structure around it, and the sentence before it when it leans on that one
(:func:`rag_opt.text.references.leans_on_previous`). :mod:`rag_opt.compressors.selection` charges a unit for
these the first time one of them is needed, and keeps them with it."""

from __future__ import annotations

from rag_opt.text.references import leans_on_previous
from rag_opt.text.units import UnitTable

__all__ = ["unit_needs"]


def unit_needs(units: UnitTable, *, antecedents: bool = True, references: bool = True) -> list[tuple[int, ...]]:
    """Per row, the rows it needs kept with it: its document's title row, the nearest heading before, its
    enclosing structure, and (English, ``antecedents``) for a sentence that opens with a back-reference
    (``It``, ``She``, ``These``, ...), the sentence just before it and what that one needs: a kept sentence never
    dangles without its antecedent. With ``references`` too, a sentence that leans on the one before through a
    demonstrative or definite reference ("than that", "this method", "The treatment ...":
    :func:`rag_opt.text.references.back_reference`) needs it the same way."""
    needs: list[tuple[int, ...]] = [()] * units.n_units
    anaphora = antecedents and units.language.split("-")[0].lower() == "en"
    for d in range(units.n_docs):
        title: int | None = None
        heading: int | None = None
        previous: int | None = None  # the sentence just before, in this document and section
        lead = ""  # the document's first sentence (two when the first is a few words): what it is about
        name = units.titles[d] if units.titles else None
        for r in units.rows(d):
            kind = units.kind[r]
            if kind == "title":
                title = r
            elif kind == "heading":
                heading = r
                previous = None
            elif units.candidate[r]:
                needs[r] = tuple(h for h in (title, heading) if h is not None) + units.enclosing(r)
                if anaphora and kind == "sentence" and previous is not None:
                    if leans_on_previous(
                        units.texts[r], units.texts[previous], title=name, lead=lead, references=references
                    ):
                        needs[r] = tuple(dict.fromkeys((*needs[r], previous, *needs[previous])))
                if kind == "sentence" and len(lead.split()) < 5:
                    lead += units.texts[r]
                previous = r if kind == "sentence" else None
    return needs
