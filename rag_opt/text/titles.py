"""Finding a document's title where users keep it: the ``title`` field, metadata, a file name, or a heading line.

rag-opt reads a title as the document's name: the proxy reads it first, the lexical tier matches it, and the second
stage links a sentence that names another document's title to that document (multi-hop questions). Retrieved chunks
rarely carry a ``title`` field, so :func:`find_title` looks, in this order, at:

1. the document's ``title`` field;
2. its metadata, key by key in ``title_keys`` order (default :data:`DEFAULT_TITLE_KEYS`: ``title``,
   ``doc_title``, ``heading``, ``name``, ``source``, ``file_path``, ``file_name``): the first non-blank string. A
   file-name key (:data:`FILE_KEYS`: ``source``, ``file_path``, ``file_name``, ``filename``) gives its file's *stem*
   (``docs/Oak_Island.md`` -> ``Oak Island``: underscores read as spaces) and only when the value names a file (a
   last path segment with an extension); a stem that is an opaque id (digits only, a hex hash, a UUID) is not a
   title;
3. with ``from_text``, a leading heading line of the text (:func:`leading_heading`): a Markdown ATX heading
   (``# Oak Island``), or a short first line with no end punctuation followed by a line break and more text
   (``Oak Island\\nOak Island is ...``). That line stays in the text and in the output, verbatim: it becomes a
   heading unit that is kept whenever anything of its document is kept, and is not rendered a second time as a
   title.

An ``id`` is never read as a title. :class:`FoundTitle` says which source was used (``OutputDocument.title_source``).

A document with no title at all still gets a *link name* for the second stage's links between documents:
:func:`leading_subject`, the subject its first sentence opens with (``Dark Horse Records is a record label ...`` ->
``Dark Horse Records``). It is never shown as a title nor rendered; it only lets a sentence of another document that
names it point here, as a title would.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rag_opt.errors import InvalidInputError, InvalidInputTypeError
from rag_opt.types import Document

__all__ = [
    "DEFAULT_TITLE_KEYS",
    "FILE_KEYS",
    "MAX_HEADING_CHARS",
    "MAX_HEADING_WORDS",
    "FoundTitle",
    "check_title_keys",
    "file_stem_title",
    "find_title",
    "leading_heading",
    "leading_subject",
]

# source: LangChain's loaders; file_path: Haystack's converters; file_name: LlamaIndex's readers
DEFAULT_TITLE_KEYS: tuple[str, ...] = ("title", "doc_title", "heading", "name", "source", "file_path", "file_name")
FILE_KEYS = frozenset({"source", "file_path", "file_name", "filename"})
MAX_HEADING_WORDS = 12
MAX_HEADING_CHARS = 120
_STRUCTURE_LINES = 4  # the lines read to tell a table's header row from a heading

TitleSource = Literal["field", "metadata", "file", "text"]

_ATX = re.compile(r"[ \t]{0,3}(#{1,6})[ \t]+(?P<title>[^\n]*?)(?:[ \t]+#+)?[ \t]*(?:\r?\n|$)")
_END_PUNCTUATION = ".!?;:,"
# list items, quotes, table rows, code, JSON, markup, URLs
_NOT_A_HEADING = re.compile(r"""\s*(?:[-*+•>|`{\[<]|\d+[.)]\s|[A-Za-z][.)]\s|https?://)""")
_LETTER = re.compile(r"[^\W\d_]")
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,5}$")
_OPAQUE = re.compile(
    r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"  # a UUID
    r"|[0-9a-fA-F]{8,}"  # a hex hash
    r"|[\d\W_]+"  # digits and punctuation only
)


@dataclass(frozen=True)
class FoundTitle:
    """A document's title and where it came from: ``source`` is ``field`` (the ``title`` field), ``metadata`` or
    ``file`` (``key``: the metadata key), or ``text`` (a leading heading line: ``span`` is its characters in the
    text, line break included)."""

    title: str
    source: TitleSource
    key: str | None = None
    span: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """How results name the source: ``field``, ``metadata.<key>`` or ``text``."""
        return f"metadata.{self.key}" if self.key is not None else self.source

    @property
    def in_text(self) -> bool:
        """Whether the title is part of the document's text (then it is not rendered again as a title line)."""
        return self.source == "text"


def check_title_keys(keys: object) -> tuple[str, ...]:
    """``keys`` as a tuple of metadata key names; a clear error for anything else."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise InvalidInputTypeError(
            f"title_keys must be a list of metadata key names, got {type(keys).__name__}"
            + (f" (did you mean [{keys!r}]?)" if isinstance(keys, str) else "")
        )
    out = []
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key.strip():
            raise InvalidInputError(f"title_keys[{i}] must be a non-empty string, got {key!r}")
        out.append(key)
    return tuple(out)


def file_stem_title(value: str) -> str | None:
    """The title a file name gives: its stem with ``_`` read as a space, or None when ``value`` names no file
    (no extension on its last path segment) or its stem is an opaque id."""
    name = re.split(r"[/\\]", value.split("?", 1)[0].split("#", 1)[0].rstrip("/\\"))[-1]
    if not _EXTENSION.search(name):
        return None
    stem = _EXTENSION.sub("", name).replace("_", " ").strip()
    if not stem or not _LETTER.search(stem) or _OPAQUE.fullmatch(stem.replace(" ", "")):
        return None
    return " ".join(stem.split())


def leading_heading(text: str) -> tuple[str, tuple[int, int]] | None:
    """The title a leading heading line gives, and the line's span (line break included), or None.

    A Markdown ATX heading on the first line (``# Title``, up to ``######``), or a first line that is short (at most
    :data:`MAX_HEADING_WORDS` words and :data:`MAX_HEADING_CHARS` characters), has a letter, does not end with
    ``. ! ? ; : ,``, does not look like a list item, quote, table row, code, JSON or a URL, does not open a structured
    block (a CSV or Markdown table, code, JSON: the segmenter's reading of the first lines), and is followed by a
    line break and more text. Blank lines before and after it are part of its span."""
    lead = len(text) - len(text.lstrip())
    m = _ATX.match(text, lead)
    if m is not None:
        title = m.group("title").strip()
        rest = text[m.end() :]
        if title and _LETTER.search(title) and rest.strip():
            return title, (0, _past_blank_lines(text, m.end()))
        return None
    end = text.find("\n", lead)
    if end < 0:
        return None
    line = text[lead:end].strip()
    rest = text[end + 1 :]
    if not line or not rest.strip() or line[-1] in _END_PUNCTUATION:
        return None
    if len(line) > MAX_HEADING_CHARS or len(line.split()) > MAX_HEADING_WORDS or not _LETTER.search(line):
        return None
    if _NOT_A_HEADING.match(line) or _structured(text):
        return None
    return line, (0, _past_blank_lines(text, end + 1))


def _structured(text: str) -> bool:
    """Whether the text opens with a structured block (a CSV or Markdown table, code, JSON), as rag-opt's segmenter
    reads its first lines: its first line is then a header row, not a title."""
    from rag_opt.text.segment import segment

    head = "\n".join(text.lstrip().split("\n", _STRUCTURE_LINES)[:_STRUCTURE_LINES])
    parts = segment(head)
    return bool(parts) and parts[0].kind not in ("sentence", "heading")


def _past_blank_lines(text: str, pos: int) -> int:
    """``pos`` moved past the blank lines that start there (the heading's span takes them, as a heading unit does)."""
    while True:
        nl = text.find("\n", pos)
        if nl < 0 or text[pos:nl].strip():
            return pos
        pos = nl + 1


_SUBJECT_END = re.compile(r"\s+(?:is|was|are|were|has|had|refers)\s|\s*[(,;:]|\s+\(")
_NOT_A_SUBJECT = frozenset(
    "a an the it its he she they we i you this that these those there here his her their our my your one some many "
    "most all each in on at for after before during when while if as".split()
)
# small words a name or a title of a work keeps in lower case ("Bank of America", "Bastard out of Carolina")
_NAME_PARTICLES = frozenset(
    "of and the a an de la le du von van der den da di del y in on at for to & - by from with out up into over upon "
    "off or but nor as".split()
)
_QUOTED = re.compile(r"[\"“«][^\"“”«»]+[\"”»]")
MAX_SUBJECT_WORDS = 8
MAX_SUBJECT_CHARS = 80


def leading_subject(text: str) -> str | None:
    """The subject the text's first sentence opens with, as a link name for a document without a title: the words
    before its first ``is``/``was``/``are``/``were``/``has``/``had``/``refers``, ``(``, ``,``, ``;`` or ``:``, when
    they start with a capital letter, a digit or a quote, read as a name (every word capitalized but particles such
    as ``of``, ``the``, ``de``, ``von``), are at most :data:`MAX_SUBJECT_WORDS` words and
    :data:`MAX_SUBJECT_CHARS` characters, and are not a pronoun or article alone (``It``, ``The``, ``This``, ...).
    Surrounding quotes are removed; a subject in quotes is a title of a work and taken as it stands
    (``"When the Levee Breaks" is a song`` → ``When the Levee Breaks``). None otherwise."""
    head = text.lstrip()[: MAX_SUBJECT_CHARS + 40].split("\n", 1)[0]
    m = _SUBJECT_END.search(head)
    if m is None or m.start() == 0:
        return None
    raw = head[: m.start()].strip()
    subject = raw.strip("\"'“”‘’«»").strip()
    if not subject or len(subject) > MAX_SUBJECT_CHARS or len(subject.split()) > MAX_SUBJECT_WORDS:
        return None
    first = subject[0]
    if not (first.isupper() or first.isdigit()) or not _LETTER.search(subject):
        return None
    if _QUOTED.fullmatch(raw):  # a quoted title of a work ("When the Levee Breaks"): its words are its own
        return subject
    if subject.lower() in _NOT_A_SUBJECT or subject.split()[0].lower() in _NOT_A_SUBJECT - {"the", "a", "an"}:
        return None
    for word in subject.split()[1:]:  # a name: every word capitalized but the small ones ("The band": no name)
        core = word.strip("\"'“”‘’«»()[]")
        if core and core.lower() not in _NAME_PARTICLES and not (core[0].isupper() or core[0].isdigit()):
            return None
    return subject


def find_title(doc: Document, keys: Sequence[str] = DEFAULT_TITLE_KEYS, *, from_text: bool = True) -> FoundTitle | None:
    """``doc``'s title by the rules of the module docstring; None when it has none."""
    if doc.title and doc.title.strip():
        return FoundTitle(doc.title, "field")
    for key in keys:
        value = doc.metadata.get(key)
        if not isinstance(value, str) or not value.strip():
            continue
        if key in FILE_KEYS:
            stem = file_stem_title(value)
            if stem is not None:
                return FoundTitle(stem, "file", key)
            continue
        return FoundTitle(value, "metadata", key)
    if from_text:
        found = leading_heading(doc.text)
        if found is not None:
            return FoundTitle(found[0], "text", span=found[1])
    return None
