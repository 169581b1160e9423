"""Other names of untitled documents (rag_opt.text.name_variants) and the links they give the second stage."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_opt.text.name_variants import MAX_SHORT_FORMS, MAX_VARIANTS, name_variants
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
        # a nickname names one person: with and without the suffix
        (
            'Earvin "Magic" Johnson Jr.',
            'Earvin "Magic" Johnson Jr. is a player.',
            ("Earvin Johnson Jr.", "Magic Johnson Jr.", "Magic Johnson"),
        ),
        # ranks of several words are honorifics too
        (
            "Air Chief Marshal Sir Keith Rodney Park",
            "Air Chief Marshal Sir Keith Rodney Park was a pilot.",
            ("Keith Rodney Park", "Keith Park"),
        ),
        # Spanish and Portuguese names: the given name with each surname in the middle
        (
            "Adolfo José Valencia Mosquera",
            "Adolfo José Valencia Mosquera is a footballer.",
            ("Adolfo Mosquera", "Adolfo Valencia"),
        ),
        ("Jorge Leal Amado de Faria", "Jorge Leal Amado de Faria was a writer.", ("Jorge Amado",)),
        # a company without its legal form; an article and a legal form
        ("Tata Sons Limited", "Tata Sons Limited is a holding company.", ("Tata Sons",)),
        ("Apple Inc.", "Apple Inc. is a company.", ("Apple",)),
        ("The Walt Disney Company Ltd", "The Walt Disney Company Ltd is a company.", ("Walt Disney Company",)),
        # other names in parentheses after "also"
        (
            "The Kellogg Company",
            "The Kellogg Company (also Kellogg's, Kellogg, and Kellogg's of Battle Creek) is a food company.",
            ("Kellogg Company", "Kellogg's", "Kellogg"),
        ),
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
    assert name_variants(subject, text, short_forms=False) == variants
    # the short forms of the given name come after the rules' variants
    assert name_variants(subject, text)[: len(variants)] == variants


@pytest.mark.parametrize(
    ("subject", "short"),
    [
        ("Richard Lee Stansbury", {"Rick Stansbury", "Dick Stansbury", "Richie Stansbury"}),
        ("Gerald Hatten Buss", {"Jerry Buss", "Gerry Buss"}),
        ("Sir Leslie Coleman McCann", {"Les McCann"}),  # after the honorific
        ("William Randolph Hearst Sr.", {"Bill Hearst Sr.", "Will Hearst Sr."}),  # the suffix stays
        ("Thomas Henry Havelock FRS", {"Tom Havelock"}),  # the surname, not the post-nominal
    ],
)
def test_short_forms_of_the_given_name(subject: str, short: set[str]) -> None:
    got = name_variants(subject, f"{subject} is a person.")
    rules = name_variants(subject, f"{subject} is a person.", short_forms=False)
    assert got[: len(rules)] == rules
    extra = got[len(rules) :]
    assert short <= set(extra)
    assert len(extra) <= MAX_SHORT_FORMS
    surname = [w for w in subject.split() if w not in ("FRS",)][-1:]
    assert all(v.split()[-1] in (surname[0], "Sr.") for v in extra)  # the surname (and its suffix) stays


def test_no_short_forms_for_names_not_in_the_table_or_not_of_persons() -> None:
    assert name_variants("Zyxw Quorn", "Zyxw Quorn is a person.") == ()
    assert name_variants("The Richard Hotel", "The Richard Hotel is a hotel.") == ("Richard Hotel",)
    assert name_variants("Richard", "Richard is a name.") == ()  # one word: no surname to keep


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


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("The city of Lawton is the county seat of Comanche County.", "Lawton"),
        ("Hurricane Faith reached the northernmost latitude of any storm.", "Hurricane Faith"),
        ("Olympique de Marseille almost won the French League.", "Olympique de Marseille"),
        ("In 1990, the band split. Then Oasis formed.", None),  # the first sentence only
        ("the lowercase text names nobody.", None),
        ("", None),
    ],
)
def test_the_opening_name_of_a_text_without_a_subject(text: str, name: str | None) -> None:
    from rag_opt.text.name_variants import opening_name

    assert opening_name(text) == name


def test_an_opening_name_links_only_where_it_is_salient() -> None:
    """A document that opens with no subject is linked by its first proper name when one other document names it,
    and not when several do (a name every document uses is no bridge)."""
    from rag_opt.compressors.context_features import SPAN_MAX_DOCS, document_links

    opening = Document(text="The city of Lawton is the county seat. It has a fort.")
    one = [opening, Document(text="Fort Sill lies near Lawton in the south."), Document(text="Tulsa is a city.")]
    units = UnitTable.build(one, lambda s: len(s.split()))
    assert units.link_names[0] is None and units.link_spans[0] == ("Lawton",)
    assert (0, 1) in document_links(units)
    many = [opening] + [Document(text=f"Road {i} runs to Lawton from the east.") for i in range(SPAN_MAX_DOCS + 1)]
    assert not any(d == 0 for d, _ in document_links(UnitTable.build(many, lambda s: len(s.split()))))
    # a document with a subject or a title has no opening name
    titled = UnitTable.build([Document(text="The city of Lawton is old.", title="Lawton")], lambda s: 1)
    subject = UnitTable.build([Document(text="Lawton is a city.")], lambda s: 1)
    assert titled.link_spans == ((),) and subject.link_spans == ((),)


@pytest.mark.parametrize(
    ("title", "text", "names"),
    [
        ("Carroll County, New Hampshire", "Carroll County is a county in New Hampshire.", ("Carroll County",)),
        ("Dunlop Tyres", "Dunlop is a brand of tyres.", ("Dunlop",)),
        ("Lawton", "Lawton is a city.", ()),  # the subject is the title: nothing new
        ("Lawton", "The city of Lawton is old.", ()),  # no subject
    ],
)
def test_the_subject_names_of_a_titled_document(title: str, text: str, names: tuple[str, ...]) -> None:
    from rag_opt.text.name_variants import subject_names

    assert subject_names(title, text) == names


def test_subject_names_keep_the_variants_of_the_subject_and_never_the_title() -> None:
    from rag_opt.text.name_variants import subject_names

    got = subject_names("Jeffrey Meldrum", 'Don Jeffrey "Jeff" Meldrum (born 1958) is an anthropologist.')
    assert got[0] == 'Don Jeffrey "Jeff" Meldrum' and {"Jeff Meldrum", "Don Meldrum"} <= set(got)
    assert "Jeffrey Meldrum" not in got


def test_a_titled_document_is_also_linked_by_its_subject_where_salient() -> None:
    """A titled document whose text opens with another name (the subject) is linked by it when it names one new
    document; not when it names several (the bound of opening names), and never twice for a link its title has."""
    from rag_opt.compressors.context_features import SPAN_MAX_DOCS, document_links

    count = lambda s: len(s.split())  # noqa: E731
    county = Document(text="Carroll County is a county in New Hampshire.", title="Carroll County, New Hampshire")
    town = Document(text="Wolfeboro is a town in Carroll County.", title="Wolfeboro")
    other = Document(text="Tulsa is a city.", title="Tulsa")
    units = UnitTable.build([county, town, other], count)
    assert units.link_spans[0] == ("Carroll County",) and units.link_spans[1] == ()
    assert (0, 1) in document_links(units) and (0, 2) not in document_links(units)
    towns = [Document(text=f"Town {i} lies in Carroll County.", title=f"Town {i}") for i in range(SPAN_MAX_DOCS + 1)]
    assert not any(d == 0 for d, _ in document_links(UnitTable.build([county, *towns], count)))
    # a heading line as the title: the subject is read after it
    headed = UnitTable.build([Document(text="Carroll County, New Hampshire\n" + county.text), town], count)
    assert headed.titles[0] == "Carroll County, New Hampshire" and headed.link_spans[0] == ("Carroll County",)
    assert (0, 1) in document_links(headed)


@given(text=st.text(max_size=300) | st.from_regex(r"([A-Z][a-z]{0,8}[ ,.\"(]{1,2}){0,12}(is|was)? ?[a-z ]{0,20}"))
@settings(max_examples=200, deadline=None)
def test_link_names_of_any_text_are_bounded_and_come_from_it(text: str) -> None:
    from rag_opt.text.name_variants import opening_name
    from rag_opt.text.titles import leading_subject

    subject = leading_subject(text)
    variants = name_variants(subject, text) if subject else ()
    assert len(variants) <= MAX_VARIANTS + MAX_SHORT_FORMS
    assert len(set(variants)) == len(variants) and subject not in variants
    assert all(len(v) >= 3 for v in variants)
    name = opening_name(text)
    assert name is None or (len(name) >= 4 and all(w in text for w in name.split()))
