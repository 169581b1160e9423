"""English back-references that are not an opening pronoun: a sentence that leans on the one before it.

:func:`back_reference` names the phrase by which a sentence refers to what the sentence before it introduced, or
returns None. The cues, chosen for precision (a false cue costs budget: the sentence before is kept with it):

- a comparative or prepositional demonstrative that stands for a whole thing said before: "more water *than that*
  can ferment", "*after that*,", "*despite this*." ("than that of ...", "that recorded in ..." refer to a noun of
  the same sentence and do not count);
- a sentence that opens with "That" as a determiner ("That year, ..."), or with "The former"/"The latter";
- a demonstrative noun phrase inside the sentence ("... with *this method*", "*these changes*", "*such a
  system*") whose noun the sentence has not named before it (for "such", one the sentence before names);
- a sentence that opens with a definite noun phrase ("*The treatment* works best ...", "However, *the company*
  ...") whose noun is a lower-case word the sentence before names, that the title does not name, and that does not
  name the document's own subject, which its first sentence introduces: "The city has ..." under "Berlin" is read
  through the title, which is kept with it anyway; without a title, the first sentence is not kept for every later
  "The film ..." (that costs facts and answers kept under a budget: ``benchmarks/ablations/antecedents.py
  --titles none``).

Capitalised words after "the" are names ("The Beatles", "the United States"), never references.
"""

from __future__ import annotations

import re

__all__ = ["back_reference", "leans_on_previous", "opens_with_pronoun", "stem"]

_WORD = re.compile(r"[A-Za-z][A-Za-z'\u2019-]*")
# an English sentence that opens with one of these refers back to the sentence before it ("It has many museums.")
_PRONOUN_OPENING = re.compile(r"^\W*(It|Its|He|His|Him|She|Her|They|Their|Them|This|These|Those)\b")

# "than that", "than this" standing for a quantity or thing said before: followed by a clause's verb or its end
_AUX = (
    r"can|could|will|would|may|might|must|shall|should|is|was|are|were|be|been|has|have|had|does|did|do|"
    r"seems?|seemed|becomes?|became"
)
_THAN_THAT = re.compile(rf"\bthan\s+(?:that|this|these|those)(?=\s*(?:[,.;:!?)]|$)|\s+(?:{_AUX})\b)")
# a preposition before a demonstrative that stands alone: "after that,", "despite this.", "because of these;"
_PREP_DEMONSTRATIVE = re.compile(
    r"\b(?:after|before|besides|despite|following|like|beyond|of|from|upon|without|about|against|besides|"
    r"during|since|until|unlike|than|to|with|for|by|on|in)\s+(?:this|that|these|those)\s*(?:[,.;:!?)]|$)",
    re.IGNORECASE,
)
_THAT_OPENING = re.compile(r"^\W*That\s+([a-z][a-z-]*)")
# "The latter was ...", "The former, ...": a pronoun (not "the former president", "the latter part")
_FORMER_LATTER = re.compile(rf"^\W*The\s+(?:former|latter)\b(?!\s+(?!(?:{_AUX})\b)[a-z])")
_DEMONSTRATIVE = re.compile(r"\b([Tt]his|[Tt]hese|[Ss]uch(?:\s+an?)?)\s+([a-z][a-z-]*)(?:\s+([a-z][a-z-]*))?")
_CONNECTIVE = (
    r"However|Thus|Therefore|Today|Currently|Later|Eventually|Initially|Originally|Subsequently|Consequently|"
    r"Moreover|Furthermore|Also|Instead|Meanwhile|Nevertheless|Nonetheless|Still|Yet|Hence|Accordingly|Again|"
    r"In addition|In turn|As a result|At first|By then|In fact|Since then"
)
_DEFINITE_OPENING = re.compile(rf"^\W*(?:(?:{_CONNECTIVE}),?\s+)?[Tt]he\s+([a-z][a-z-]*)")

# words after "that", "this", "the" that are not the head noun of a phrase referring back
_NOT_A_HEAD = frozenset(
    """
    a an the this that these those he she it they we you i his her its their our my your him them us me
    is was are were be been being has have had do does did can could will would may might must shall should
    not also only just even still then there here which who whom whose what when where why how whether if
    as of in on at to for from by with about into onto over under than and or but so because while though
    although same other others following first second third fourth fifth last next final former latter
    most more least less many much few several some any all both each every either neither no such very
    main new old original current previous present whole entire remaining late early own top best
    one two three four five six seven eight nine ten hundred thousand million
    """.split()
)
# nouns too general to say that "the" + the noun points at the sentence before ("The number of ...", "The end of")
_GENERIC = frozenset(
    "way time year day period point case kind sort type number part end rest majority lack use name area world".split()
)
# words between a determiner and its noun: "these four countries", "this same method"
_MODIFIERS = frozenset(
    "same other two three four five six seven eight nine ten first second third last new original latter former".split()
)
# a "such" that is not a reference: "such as", "such that"
_NOT_SUCH = frozenset({"as", "that"})


def stem(word: str) -> str:
    """A crude English stem, enough to match "treatment" with "treatments" and "cities" with "city"."""
    w = word.lower().replace("\u2019", "'")
    if w.endswith("'s"):
        w = w[:-2]
    w = w.strip("'-")
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 4 and w.endswith(("ches", "shes", "sses", "xes")):
        return w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        return w[:-1]
    return w


def _stems(text: str) -> set[str]:
    return {stem(w) for w in _WORD.findall(text)}


def _head(word: str) -> bool:
    """Whether ``word`` can be the head noun of a referring phrase (not a function word, number or adjective of
    order, and not an adverb or superlative by its ending)."""
    return (
        len(word) > 2
        and word not in _NOT_A_HEAD
        and not word.endswith(("ly", "est"))
        and not word.endswith(("ing",))  # "this being", "the following"
    )


def opens_with_pronoun(sentence: str) -> bool:
    """Whether an English ``sentence`` opens with a pronoun that refers back ("It has many museums.")."""
    return _PRONOUN_OPENING.match(sentence) is not None


def leans_on_previous(
    sentence: str, previous: str, *, title: str | None = None, lead: str | None = None, references: bool = True
) -> bool:
    """Whether ``sentence`` needs ``previous`` (the sentence just before it) to be read: it opens with a pronoun,
    or (``references``) it refers back through a phrase :func:`back_reference` finds."""
    return opens_with_pronoun(sentence) or (
        references and back_reference(sentence, previous, title=title, lead=lead) is not None
    )


def back_reference(sentence: str, previous: str, *, title: str | None = None, lead: str | None = None) -> str | None:
    """The phrase by which ``sentence`` leans on ``previous`` (the sentence just before it, in the same document
    and section), or None. ``title``: the document's title; ``lead``: the document's first sentence, which says
    what the document is about (see the module docstring)."""
    text = sentence.strip()
    m = _THAN_THAT.search(text) or _PREP_DEMONSTRATIVE.search(text) or _FORMER_LATTER.match(text)
    if m:
        return m.group(0).strip()
    m = _THAT_OPENING.match(text)
    if m and _head(m.group(1)):
        return m.group(0).strip()
    known = _stems(title) if title else set()  # what the title names (kept with the sentence anyway)
    if lead is not None:
        # "The club", "this film": the document's own subject, which its title names (kept with the sentence) or,
        # without a title, its first sentence introduces; keeping that first sentence for every later mention
        # costs the budget more than it gains (measured: benchmarks/ablations/antecedents.py --titles none)
        known |= _stems(lead)
    for m in _DEMONSTRATIVE.finditer(text):
        det = m.group(1).lower()
        if m.start() == 0 and det in ("this", "these"):
            continue  # an opening demonstrative is the pronoun rule's
        if det == "this" and _verb_like(m.group(2)):
            continue  # "this includes", "this means": a pronoun subject, of this sentence's own clause
        head = _head_of(m.group(2), m.group(3))
        if head is None or det.startswith("such") and m.group(2) in _NOT_SUCH:
            continue
        if det.startswith("such") and head not in _stems(previous):
            continue  # "such a large": a degree, unless the sentence before names the noun
        if head not in known and head not in _stems(text[: m.start()]):
            return m.group(0).strip()
    m = _DEFINITE_OPENING.match(text)
    if m and _head(m.group(1)) and stem(m.group(1)) not in _GENERIC:
        head = stem(m.group(1))
        if head in _stems(previous) and head not in known:
            return m.group(0).strip()
    return None


def _verb_like(word: str) -> bool:
    """A word after the singular "this" that ends like a verb's third person ("includes", "means"), not a noun."""
    return word.endswith("s") and not word.endswith(("ss", "us", "is"))


def _head_of(first: str, second: str | None) -> str | None:
    """The stem of the head noun after a determiner: the first word, or the second after a number or an adjective
    of order ("these four countries", "this same method"); None when neither can be one."""
    if _head(first):
        return stem(first)
    if first in _MODIFIERS and second is not None and _head(second):
        return stem(second)
    return None
