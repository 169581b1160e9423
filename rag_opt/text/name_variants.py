"""Other names an untitled document goes by, for the second stage's links between documents.

A document without a title is linked by the subject its text opens with (:func:`rag_opt.text.titles.leading_subject`).
That subject is often the *formal* name, and other documents use the common one: "Sergey Olegovich Sirotkin" is
named "Sergey Sirotkin" elsewhere, "Dame Joan Alston Sutherland" is "Joan Sutherland", 'Heywood "Woody" Allen' is
"Woody Allen", and "Richard Colson Baker (...), better known by his stage name Machine Gun Kelly" is "Machine Gun
Kelly". A title field carries the common name; :func:`name_variants` recovers it from the text, so that untitled
documents are linked as titled ones are.

The variants (each at least 3 characters, none equal to the subject):

* the subject without a leading article, when at least two words remain ("The Drudge Report" → "Drudge Report");
* a company's name without its legal form ("Tata Sons Limited" → "Tata Sons", "Apple Inc." → "Apple");
* for a name of three or more capitalized words: the name without leading honorifics and ranks (``Sir``, ``Dame``,
  ``Dr.``, ``Rear Admiral``, ``Air Chief Marshal``, ``Duke``, ...) and trailing post-nominals (``OBE``, ``PhD``,
  ...), and its first and last word ("Sir Anthony Peter McCoy, OBE" → "Anthony Peter McCoy", "Anthony McCoy"). A
  generational suffix (``Jr.``, ``III``) stays: "John Herschel Glenn Jr." → "John Glenn Jr." (a "Jr." is another
  person than his father);
* for a name of four or more words, the given name with each surname between the second word and the last
  (Spanish and Portuguese names: "Adolfo José Valencia Mosquera" → "Adolfo Valencia", "Jorge Leal Amado de Faria" →
  "Jorge Amado");
* a nickname in quotes with the surname ('Ernesto "Che" Guevara' → "Che Guevara"; 'Earvin "Magic" Johnson Jr.' →
  "Magic Johnson Jr." and "Magic Johnson": a nickname names one person);
* the names the first sentence gives it: "known as X", "better known as X or Y", "known by his stage name X",
  "referred to as X", "credited as X", "(also X, Y)";
* at most :data:`MAX_SHORT_FORMS` more: the short forms of a person's given name with the surname ("Richard Lee
  Stansbury" → "Rick Stansbury", "Dick Stansbury", ...; "Gerald Hatten Buss" → "Jerry Buss"), from the hand-curated
  English table of the ``nicknames`` package.

A document that opens with no subject ("The city of Lawton is the county seat ...", "Hurricane Faith reached ...")
is linked by :func:`opening_name`, the first proper name of its first sentence ("Lawton", "Hurricane Faith"), but
only where it is salient: when at most one other document names it (``context_features.SPAN_MAX_DOCS``), so that
"American" or "United States" does not link a document to every other.

A *titled* document is also linked, under the same bound, by :func:`subject_names`: the subject its text opens with
when that is not its title ("Carroll County" under the title "Carroll County, New Hampshire") and the subject's
variants.

Variants are matched case-sensitively (:mod:`rag_opt.compressors.context_features`): a variant is a proper name, so
"The Bridge" does not make every "the bridge" a link. Measured in ``docs/benchmarks.md`` (title-free links).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from nicknames import NickNamer

__all__ = ["MAX_SHORT_FORMS", "MAX_VARIANTS", "name_variants", "opening_name", "subject_names"]

MAX_VARIANTS = 6  # at most this many variants per document by the rules above
MAX_SHORT_FORMS = 16  # and at most this many by the short forms of the given name

_ARTICLES = frozenset({"the", "a", "an"})
_HONORIFICS = frozenset(
    "sir dame lord lady dr dr. saint st. king queen prince princess general gen. captain capt. president senator "
    "reverend rev. mr. mrs. ms. admiral rear vice colonel col. major lieutenant lt. sergeant professor prof. judge "
    "chief father pope emperor empress sheikh air field marshal commodore brigadier governor bishop archbishop "
    "cardinal rabbi imam count countess duke duchess baron baroness earl marquess viscount sultan tsar chancellor "
    "commander".split()
)
_POST_NOMINALS = frozenset("obe kbe cbe mbe dbe gbe om ac kc qc pc frs phd md".split())
_GENERATIONAL = frozenset("jr. jr sr. sr ii iii iv".split())
# a company's legal form: "Tata Sons Limited" is "Tata Sons" elsewhere
_LEGAL_FORMS = frozenset("limited ltd ltd. inc inc. plc llc l.p. lp gmbh ag s.a. n.v. corp. co.".split())
_PARTICLES = frozenset("of and the a an de la le du von van der den da di del y".split())
_WORD = r"[\w'’.\-]*"  # the rest of a capitalized word
_CONNECTORS = r"of|the|de|van|von|da|la|del|di|&"  # the small words a proper name keeps between its capitals
_NAME = rf"(?:[A-Z0-9]{_WORD})(?:\s+(?:[A-Z0-9]{_WORD}|{_CONNECTORS}))*"
_ALIAS = re.compile(
    r"(?:\(also\s+(?:called\s+|spelled\s+)?(?=[\"“A-Z0-9])"
    r"|\b(?:known|referred to|credited|billed)\s+(?:simply\s+|mononymously\s+|professionally\s+)?(?:as|by)\s+)"
    r"(?:(?:his|her|their|its|the)\s+)?(?:(?:mononymous|stage|ring|pen|nick|short|shortened)\s*names?\s+)?[\"“]?"
    r"(" + _NAME + r")(?:[\"”]?\s*(?:,\s*|\s+or\s+|\s+and\s+)[\"“]?(" + _NAME + r"))?"
)
_NICKNAME = re.compile(r"[\"“]([A-Z][\w'’.\-]*(?:\s+[A-Z][\w'’.\-]*)?)[\"”]")
_FIRST_SENTENCE_CHARS = 400
_PROPER_SPAN = re.compile(rf"(?<!\w)[A-Z]{_WORD}(?:\s+(?:(?:{_CONNECTORS})\s+)?[A-Z]{_WORD})*")
_SPAN_STOP = frozenset(
    "the a an it its he she they this that these those in on at for after before during when while if as his her "
    "their".split()
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def name_variants(subject: str, text: str, *, short_forms: bool = True) -> tuple[str, ...]:
    """Other names of a document whose text opens with ``subject`` (see the module docstring), in a fixed order,
    without duplicates; empty when there are none. ``short_forms``: with the given name's short forms (last)."""
    out: list[str] = []
    words = subject.split()
    if not words:
        return ()
    if len(words) >= 2 and words[-1].strip(",").lower() in _LEGAL_FORMS:
        core = " ".join(words[:-1]).rstrip(",")
        if words[0].lower() in _ARTICLES and len(words) >= 4:
            out.append(" ".join(words[1:-1]).rstrip(","))
        elif len(core) >= 3 and words[0].lower() not in _ARTICLES:
            out.append(core)
    elif words[0].lower() in _ARTICLES:
        if len(words) >= 3:
            out.append(" ".join(words[1:]))
    else:
        out += _person_variants(subject)
    first = text.lstrip().split("\n", 1)[0][:_FIRST_SENTENCE_CHARS]
    for m in _ALIAS.finditer(first):
        out += [g.strip(" .,'\"”") for g in m.groups() if g]
    seen = {subject}
    kept: list[str] = []
    for v in out:
        if len(v) >= 3 and v not in seen:
            seen.add(v)
            kept.append(v)
    kept = kept[:MAX_VARIANTS]
    if short_forms and words[0].lower() not in _ARTICLES:
        kept += [v for v in _short_forms(subject) if v not in seen][:MAX_SHORT_FORMS]
    return tuple(kept)


@lru_cache(maxsize=1)
def _nicknamer() -> NickNamer:
    from nicknames import NickNamer

    return NickNamer()


class _PersonName(NamedTuple):
    plain: list[str]  # the words, without a quoted nickname
    words: list[str]  # without leading honorifics, trailing post-nominals and a generational suffix
    suffix: str  # " Jr." or ""
    nickname: str | None  # the quoted nickname, if any


def _person_name(subject: str) -> _PersonName:
    nickname = _NICKNAME.search(subject)
    plain = [w for w in (w.strip(",") for w in _NICKNAME.sub(" ", subject).split()) if w]
    words = list(plain)
    while len(words) > 2 and words[0].lower() in _HONORIFICS:
        words = words[1:]
    while len(words) > 2 and words[-1].lower() in _POST_NOMINALS:
        words = words[:-1]
    suffix = ""
    if len(words) > 2 and words[-1].lower() in _GENERATIONAL:
        suffix, words = " " + words[-1], words[:-1]
    return _PersonName(plain, words, suffix, nickname.group(1) if nickname else None)


def _short_forms(subject: str) -> list[str]:
    """A person's name with the short forms of the given name: "Richard Lee Stansbury" → "Rick Stansbury", "Dick
    Stansbury", ... (the ``nicknames`` package's hand-curated English table); none for a name not in it."""
    _, words, suffix, _ = _person_name(subject)
    if len(words) < 2 or not all(w[0].isupper() for w in (words[0], words[-1])):
        return []
    return [f"{short.capitalize()} {words[-1]}{suffix}" for short in sorted(_nicknamer().nicknames_of(words[0]))]


def _person_variants(subject: str) -> list[str]:
    """The variants of a name that does not open with an article: honorifics and post-nominals dropped, first and
    last word, nickname and surname, given name and each middle surname."""
    out: list[str] = []
    plain, words, suffix, nickname = _person_name(subject)
    if words and words != plain:
        out.append(" ".join(words) + suffix)
    if len(words) >= 3 and all(w[0].isupper() for w in words) and words[-2].lower() not in _PARTICLES:
        out.append(f"{words[0]} {words[-1]}{suffix}")
    if nickname and len(words) >= 2:
        out.append(f"{nickname} {words[-1]}{suffix}")
        if suffix:  # a nickname names one person: "Magic Johnson" is Earvin "Magic" Johnson Jr.
            out.append(f"{nickname} {words[-1]}")
    if len(words) >= 4 and all(w[0].isupper() or w.lower() in _PARTICLES for w in words):
        # Iberian names: "Adolfo José Valencia Mosquera" is "Adolfo Valencia", "Jorge Leal Amado de Faria" is
        # "Jorge Amado": the given name with each surname in the middle
        out += [f"{words[0]} {w}{suffix}" for w in words[2:-1] if w[0].isupper()]
    return out


def opening_name(text: str) -> str | None:
    """The first proper name of the text's first sentence (capitalized words, joined by particles such as "of";
    a leading article or pronoun dropped; at least 4 characters): the link name of a document that opens with no
    subject. None when the first sentence has none."""
    first = _SENTENCE_END.split(text.lstrip().split("\n", 1)[0][:_FIRST_SENTENCE_CHARS], maxsplit=1)[0]
    for m in _PROPER_SPAN.finditer(first):
        words = m.group(0).split()
        while words and words[0].lower() in _SPAN_STOP:
            words = words[1:]
        name = " ".join(words).rstrip(".")
        if len(name) >= 4:
            return name
    return None


def subject_names(title: str, text: str) -> tuple[str, ...]:
    """Names a *titled* document's text gives it besides its title: the subject its text opens with and that
    subject's :func:`name_variants`, when the subject is not the title itself (none otherwise). Under the title
    "Carroll County, New Hampshire" the text opens with "Carroll County"; under "Dunlop Tyres", with "Dunlop";
    under "Jeffrey Meldrum", with 'Don Jeffrey "Jeff" Meldrum' (→ "Don Meldrum", "Jeff Meldrum", ...). Links by
    them count only where salient (``context_features.SPAN_MAX_DOCS``)."""
    from rag_opt.text.titles import leading_subject

    subject = leading_subject(text)
    if not subject or subject == title:
        return ()
    return tuple(n for n in (subject, *name_variants(subject, text)) if n != title)
