"""Other names of untitled documents (rag_opt.text.name_variants) and the links they give the second stage."""

from __future__ import annotations

import numpy as np
import pytest

from rag_opt.text.name_variants import MAX_VARIANTS, name_variants
from rag_opt.text.units import UnitTable
from rag_opt.types import Document


@pytest.mark.parametrize(
    ("subject", "text", "variants"),
    [
        # middle names: first and last word
        (
            "Sergey Olegovich Sirotkin",
            "Sergey Olegovich Sirotkin (born 1995) is a racing driver.",
            ("Sergey Sirotkin",),
        ),
        # honorifics and post-nominals dropped, then first and last word
        (
            "Sir Anthony Peter McCoy",
            "Sir Anthony Peter McCoy, OBE (born 4 May 1974), commonly known as A. P. McCoy or Tony McCoy, is a jockey.",
            ("Anthony Peter McCoy", "Anthony McCoy", "A. P. McCoy", "Tony McCoy"),
        ),
        (
            "Dame Joan Alston Sutherland",
            "Dame Joan Alston Sutherland was a soprano.",
            ("Joan Alston Sutherland", "Joan Sutherland"),
        ),
        # a nickname in quotes with the surname; two words are already the common form
        ('Heywood "Woody" Allen', 'Heywood "Woody" Allen (born 1935) is a filmmaker.', ("Woody Allen",)),
        # a generational suffix stays: a Jr. is not his father
        ("John Herschel Glenn Jr.", "John Herschel Glenn Jr. was an astronaut.", ("John Glenn Jr.",)),
        # the names the first sentence gives
        (
            "Richard Colson Baker",
            "Richard Colson Baker (born 1990), better known by his stage names MGK and Machine Gun Kelly, is a rapper.",
            ("Richard Baker", "MGK", "Machine Gun Kelly"),
        ),
        # a leading article: dropped when two words remain, no person rules
        ("The Drudge Report", "The Drudge Report is a news website.", ("Drudge Report",)),
        ("The Bridge", "The Bridge is a film.", ()),
        ("The King Mosque", "The King Mosque is a mosque.", ("King Mosque",)),
        # nothing to vary: a two-word name, an album title, a particle before the last word
        ("Queen II", "Queen II is an album.", ()),
        ("Dark Horse Records", "Dark Horse Records is a label.", ("Dark Records",)),
        ("Ludwig van Beethoven", "Ludwig van Beethoven was a composer.", ()),
        ("", "", ()),
    ],
)
def test_name_variants(subject: str, text: str, variants: tuple[str, ...]) -> None:
    assert name_variants(subject, text) == variants


def test_name_variants_are_bounded_and_distinct() -> None:
    text = (
        "X Y Z, known as Alpha or Beta, also known as Gamma and Delta, credited as Alpha, billed as Eta and Theta, is."
    )
    got = name_variants("Xavier Yusuf Zed", text)
    assert got == ("Xavier Zed", "Alpha", "Beta", "Gamma", "Delta", "Eta")[:MAX_VARIANTS]
    assert name_variants("Xavier Yusuf Zed", "X Y Z, known as Al, is.") == ("Xavier Zed",)  # under 3 characters


def _named_first(opening: str, mention: str) -> float:
    """``named_by_other`` of the first of two untitled documents (its best candidate row): the first opens with
    ``opening``, the second holds ``mention``."""
    from rag_opt.compressors.context_features import CONTEXT_FEATURES, context_features

    units = UnitTable.build([Document(text=opening), Document(text=mention)], lambda s: len(s.split()))
    feats = context_features(np.linspace(-1.0, 1.0, units.n_units), units)
    named = feats[:, CONTEXT_FEATURES.index("named_by_other")]
    return float(named[[r for r in units.rows(0) if units.candidate[r]]].max())


def test_an_untitled_document_is_linked_by_its_common_name() -> None:
    """The second document names the first by the common name its formal subject varies to: a link, as a title
    would give; without the variant (a document that opens with another name) there is none."""
    mention = "The team signed Sergey Sirotkin in 2018. It finished last."
    linked = _named_first("Sergey Olegovich Sirotkin is a racing driver. He drives for a team.", mention)
    unlinked = _named_first("Sergey Olegovich Petrov is a racing driver. He drives for a team.", mention)
    assert linked > unlinked
    units = UnitTable.build([Document(text="Sergey Olegovich Sirotkin is a racing driver.")], lambda s: 1)
    assert units.link_variants == (("Sergey Sirotkin",),)
    titled = UnitTable.build(
        [Document(text="Sergey Olegovich Sirotkin is a driver.", title="S. Sirotkin")], lambda s: 1
    )
    assert titled.link_variants == ((),)


def test_variants_are_matched_case_sensitively() -> None:
    """A variant is a proper name: its lower-case words elsewhere are no link."""
    opening = "The Silver Bridge Company is a builder. It builds bridges."
    lower = _named_first(opening, "The river has a silver bridge company nearby. It is old.")
    named = _named_first(opening, "The river has the Silver Bridge Company nearby. It is old.")
    assert named > lower
