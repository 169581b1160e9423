"""Back-references beyond an opening pronoun (issue 54): which sentences lean on the sentence before them."""

from __future__ import annotations

import numpy as np
import pytest

from rag_opt.compressors.selection import SelectionOptions, select
from rag_opt.compressors.unit_needs import unit_needs
from rag_opt.text.references import back_reference, stem
from rag_opt.text.tokens import get_token_counter
from rag_opt.text.units import UnitTable
from rag_opt.types import to_documents

COUNT = get_token_counter("o200k_base").count


@pytest.mark.parametrize(
    ("previous", "sentence"),
    [
        ("Honey is about 17% water.", "Honey with more water than that can ferment."),
        ("Doctors give a treatment of oseltamivir for the flu.", "The treatment works best in early winter."),
        ("Cooks cure the ham in salt for a year.", "Many farms still use this method."),
        ("He lost the election in 1990.", "After that, he retired to Ohio."),
        ("The town built a new bridge.", "However, the bridge collapsed in 1903."),
        ("The band recorded two albums in Berlin.", "Critics praised these albums for their sound."),
        ("Madrid and Lisbon bid for the games.", "The latter was chosen."),
        ("The league banned the tackle in 1920.", "That rule still stands."),
        ("It was built by a guild of masons.", "Such a guild was rare in Spain."),
    ],
)
def test_a_demonstrative_or_definite_back_reference_leans_on_the_sentence_before(previous: str, sentence: str) -> None:
    assert back_reference(sentence, previous)


@pytest.mark.parametrize(
    ("previous", "sentence", "title"),
    [
        # "the" + a noun the sentence before does not name: not a reference to it
        ("Doctors treat the flu with oseltamivir.", "The vaccine is given in autumn.", None),
        # names are not references, whatever the sentence before says
        ("The United States entered the war.", "The United States won.", None),
        # a comparison with a noun of the same sentence
        ("Paris is large.", "Its area is smaller than that of London.", None),
        ("Prices rose.", "The rate in 2001 was higher than that recorded in 1990.", None),
        # the demonstrative's noun was named earlier in the same sentence
        ("He moved.", "He wrote a novel in 1990, and this novel sold well.", None),
        # "such as", "this includes": no reference
        ("Bees make honey.", "Many products, such as wax, come from hives.", None),
        ("The list is long.", "The total, and this includes the exports, is large.", None),
        # the document's own subject, which the title names and which is kept with the sentence anyway
        ("Laleli Mosque was built in 1763.", "The mosque has two minarets.", "Laleli Mosque"),
        ("Cork City F.C. is an Irish football club.", "The club plays at Turners Cross.", "Cork City F.C."),
        # "the" + an adjective or a function word
        ("He came first.", "The first race was in May.", None),
    ],
)
def test_what_is_not_a_back_reference(previous: str, sentence: str, title: str | None) -> None:
    lead = previous if title else None
    assert back_reference(sentence, previous, title=title, lead=lead) is None


def test_the_documents_own_subject_is_no_reference_with_or_without_a_title() -> None:
    # "the club" is the subject the first sentence introduces: keeping that sentence for every later mention costs
    # facts under a budget (antecedents.py --titles none), so it is no cue, titled or not
    lead = "Cork City F.C. is an Irish football club."
    assert back_reference("The club plays at Turners Cross.", lead, title=None, lead=lead) is None
    assert back_reference("The club plays at Turners Cross.", lead, title="Cork City F.C.", lead=lead) is None
    # a noun the sentence before introduces that the first sentence does not is still a reference
    before = "In 2005 it adopted a new treatment of its pitch."
    assert back_reference("The treatment works best in early winter.", before, title=None, lead=lead)


def test_stem_matches_plurals() -> None:
    assert stem("treatments") == stem("treatment") and stem("cities") == stem("city") and stem("bus") == "bus"


def test_keep_references_keeps_the_sentence_a_reference_leans_on() -> None:
    """'Honey with more water than that can ferment.' is kept with the sentence that says what 'that' is (the
    default); the rule of openings only (``keep_references=False``) does not see it."""
    docs = to_documents(
        [
            {"title": "Honey", "text": "Honey is about 17% water. Honey with more water than that can ferment."},
            {"title": "Bees", "text": "Bees make honey. A hive holds 50,000 bees."},
        ]
    )
    units = UnitTable.build(docs, COUNT)
    rows = {units.texts[r].strip(): r for r in range(units.n_units)}
    leaning, before = rows["Honey with more water than that can ferment."], rows["Honey is about 17% water."]
    assert before not in unit_needs(units, references=False)[leaning]
    assert before in unit_needs(units)[leaning]
    scores = np.zeros(units.n_units)
    scores[leaning] = 5.0
    scores[rows["Bees make honey."]] = 1.0
    room = int(units.tokens[0] + units.tokens[leaning]) + 1  # the title and the sentence, not its antecedent
    openings = select(units, scores, COUNT, limit=room, options=SelectionOptions(keep_references=False))
    assert openings.keep[leaning] and not openings.keep[before]  # dangles
    extended = select(units, scores, COUNT, limit=room)
    assert not extended.keep[leaning] or extended.keep[before]
    both = select(units, scores, COUNT, limit=room + int(units.tokens[before]))
    assert both.keep[leaning] and both.keep[before] and both.reasons[before] == "antecedent"
    assert both.texts[0] == "Honey is about 17% water. Honey with more water than that can ferment."
    # the antecedent rule off turns this one off too; other languages get none
    off = SelectionOptions(keep_antecedents=False)
    assert select(units, scores, COUNT, limit=room, options=off).keep[leaning]
    de = UnitTable.build(to_documents(["Honig ist süß. Honey with more water than that can ferment."]), COUNT, "de")
    assert all(len(n) == 0 for r, n in enumerate(unit_needs(de)) if de.kind[r] == "sentence")
