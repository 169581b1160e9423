"""Which part of a chat completion request is context, and writing the optimized context back in place.

The question is the text of the last ``user`` message (its text parts joined by newlines, document blocks
removed), unless the request's ``rag_opt.query`` gives one. Context is, in this order:

1. ``<document ...>...</document>`` blocks (the tag is configurable; attributes such as ``id="..."`` and
   ``title="..."`` are read from the opening tag) inside ``system``/``developer`` messages, the last ``user``
   message, and ``tool``/``function`` messages after it (the current turn). A block's text between its tags
   (leading and trailing whitespace kept aside) is one document, optimized in place: kept sentences verbatim,
   dropped documents removed with their tags, and with a re-ordering, whole blocks move between the block
   positions of the same message text. An empty block (nothing but whitespace between the tags) is not a
   document: it is forwarded as it is and keeps its place. A document or a question holding a lone UTF-16
   surrogate (a ``\\ud800``-style escape without its pair: not Unicode text) is a 400 naming where, as on every
   route (:func:`rag_opt.wire.request.lone_surrogate`). Blocks are found by
   :func:`rag_opt.wire.markup.scan` in linear time: quoted attribute values may contain ``>``; with nested
   blocks, the innermost ones are the documents and the tags around them stay as they are; unmatched tags are
   text.
2. ``tool``/``function`` messages of the current turn without blocks whose text is at least
   ``tool_min_chars`` long: the whole text is one document, marked ``required`` (the optimizer keeps at least
   its best unit, so the message is never emptied). A tool result that is one JSON value or a table is
   compressed at its own grain (array items, object members, table rows: :mod:`rag_opt.text.structure`).
3. ``rag_opt.documents`` in the request's extension field: rendered as ``<document id=".." title="..">``
   blocks at the start of the last user message (``placement: "user"``, the default) or at the end of the
   first system message (``placement: "system"``); the ``rag_opt`` field is always removed before forwarding.
   Empty ones are rendered as they are, in their place, and not optimized.

The request itself is read and validated by :mod:`rag_opt.wire.request`. Everything else is forwarded byte
for byte: the new request body is the original bytes with only the changed JSON string values replaced (and the
``rag_opt`` member removed, the extension documents inserted; :mod:`rag_opt.wire.json_edit`), so key order,
whitespace, number formatting and escapes elsewhere are untouched. A request without context is forwarded as
the original bytes. No scoring, selecting or ordering happens here: that is
:meth:`rag_opt.ContextOptimizer.optimize`.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rag_opt.wire.errors import RewriteError
from rag_opt.wire.json_edit import Edit, JsonEditor, JsonPath, apply_edits
from rag_opt.wire.markup import parse_attributes, scan, strip_blocks
from rag_opt.wire.request import EXTENSION_FIELD, Options, lone_surrogate

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import Document, OptimizeResult

__all__ = [
    "SYSTEM_ROLES",
    "TOOL_ROLES",
    "Container",
    "ContextPlan",
    "Found",
    "Placer",
    "Remover",
    "has_lone_surrogate",
    "json_path",
    "parse_attributes",
    "place_first",
    "texts_of",
]

SYSTEM_ROLES = ("system", "developer")
TOOL_ROLES = ("tool", "function")


_SURROGATE = re.compile("[\ud800-\udfff]")
_BLANKS = re.compile(r"\s+")  # (maximal runs, matched once each: no backtracking over a long run)


def _one_newline(m: re.Match[str]) -> str:
    """A blank run with a line break becomes one line break; one without stays as it is."""
    return "\n" if "\n" in m.group() else m.group()


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a UTF-16 surrogate on its own (from a ``\\ud800``-style JSON escape): it cannot
    be encoded, so a request whose documents or question hold one is refused."""
    return _SURROGATE.search(text) is not None


def json_path(path: JsonPath) -> str:
    """``("messages", 2, "content", 0, "text")`` as ``messages[2].content[0].text`` (an error's ``param``)."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


@dataclass
class Found:
    """One context document: its text and where it lives (``container`` None: from the extension field)."""

    text: str
    id: str | None = None
    title: str | None = None
    container: int | None = None
    start: int = 0  # span of the whole block (or the whole text) in the container's string
    end: int = 0
    open_tag: str = ""
    close_tag: str = ""
    lead: str = ""
    trail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # extension documents: metadata, score
    required: bool = False  # the whole text of a message: the optimizer never drops it entirely

    def as_input(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"text": self.text, **self.extra}
        if self.id is not None:
            doc["id"] = self.id
        if self.title is not None:
            doc["title"] = self.title
        if self.required:
            doc["required"] = True
        return doc

    def block(self, text: str) -> str:
        return self.open_tag + self.lead + text + self.trail + self.close_tag


@dataclass
class Container:
    """A JSON string that holds documents, and where it is in the body (e.g. ``("messages", 2, "content")``)."""

    path: JsonPath
    text: str
    whole: bool = False  # the whole text is one document (a large tool message)
    item: JsonPath | None = None  # the content block removed when the text ends up blank (an API refuses those)


def _optimizable(text: str, path: JsonPath) -> bool:
    """A document worth optimizing: not empty. A :class:`~rag_opt.wire.errors.RequestError` (a 400 naming
    ``path``) when it holds a lone surrogate: not Unicode text, it cannot be read."""
    if has_lone_surrogate(text):
        raise lone_surrogate(json_path(path), json_path(path))
    return bool(text.strip())


def _split_ws(body: str) -> tuple[str, str, str]:
    core = body.strip()
    if not core:
        return body, "", ""
    lead = body[: len(body) - len(body.lstrip())]
    trail = body[len(body.rstrip()) :]
    return lead, core, trail


def texts_of(content: Any, path: JsonPath, part_type: str = "text") -> list[tuple[JsonPath, str]]:
    """The texts of a message ``content`` at ``path``: the string itself, or the ``text`` of each part of type
    ``part_type``, each with its path."""
    if isinstance(content, str):
        return [(path, content)]
    if isinstance(content, list):
        return [
            ((*path, j, "text"), p["text"])
            for j, p in enumerate(content)
            if isinstance(p, dict) and p.get("type") == part_type and isinstance(p.get("text"), str)
        ]
    return []


Placer = Callable[["ContextPlan", JsonEditor, dict[JsonPath, str], str], list[Edit]]
"""Inserts the rendered extension documents (the text) into a request body of one API: a new value for a
string goes into the dict (by path), anything else is an edit; raises RewriteError when there is no place."""

Remover = Callable[["ContextPlan", JsonEditor, dict[JsonPath, str]], list[Edit]]
"""Removes the content blocks left blank, as :meth:`ContextPlan.remove_blank` does (an API's own rules: e.g.
Anthropic's cache breakpoints and citation indexes)."""


def place_first(
    editor: JsonEditor, values: dict[JsonPath, str], path: JsonPath, content: Any, part_type: str, text: str
) -> list[Edit] | None:
    """Put ``text`` first in the message ``content`` at ``path``: before a string content, or as a new first part
    of type ``part_type``; None when the content is neither."""
    if isinstance(content, str):
        values[path] = text + "\n\n" + values.get(path, content)
        return []
    if isinstance(content, list) and editor.is_array(path):
        return [editor.insert_first(path, {"type": part_type, "text": text})]
    return None


# -- the plan -----------------------------------------------------------------------------------------------
@dataclass
class ContextPlan:
    """The context found in one request and how to write an optimization result back."""

    raw: bytes
    body: dict[str, Any]
    tag: str
    query: str | None
    options: Options
    documents: list[Found] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)
    has_extension_field: bool = False
    # the extension documents in request order: an index into ``documents``, or an empty document (not optimized)
    extension: list[int | Found] = field(default_factory=list)
    placer: Placer | None = None  # where the extension documents go (each API's planner sets it)
    remover: Remover | None = None  # removes the blocks left blank (None: :meth:`remove_blank`)

    # -- finding (the planners of each API call these) --
    def add_text(self, path: JsonPath, text: str, whole_min: int | None = None, item: JsonPath | None = None) -> None:
        """The context in the string at ``path``: its non-empty ``<tag>`` blocks, each a document; without any,
        the whole text as one document when ``whole_min`` is given and the text is at least that long. ``item``:
        the array item (a content block) to remove instead of leaving this text blank."""
        found = scan(text, self.tag).documents
        blocks = [b for b in found if _optimizable(text[b.body_start : b.body_end], path)]
        if not blocks:
            if whole_min is not None and len(text.strip()) >= max(whole_min, 1):
                self.add_whole(path, text, item=item, required=True)  # a message that had content is never emptied
            return
        self.containers.append(Container(path=path, text=text, item=item))
        for b in blocks:
            lead, core, trail = _split_ws(text[b.body_start : b.body_end])
            self.documents.append(
                Found(
                    text=core,
                    id=b.attrs.get("id"),
                    title=b.attrs.get("title") or None,
                    container=len(self.containers) - 1,
                    start=b.start,
                    end=b.end,
                    open_tag=text[b.start : b.body_start],
                    close_tag=text[b.body_end : b.end],
                    lead=lead,
                    trail=trail,
                )
            )

    def add_whole(
        self,
        path: JsonPath,
        text: str,
        title: str | None = None,
        item: JsonPath | None = None,
        required: bool = False,
    ) -> None:
        """The whole string at ``path`` as one document (not when empty or not encodable); ``item``: as in
        :meth:`add_text`; ``required``: the optimizer keeps at least its best unit."""
        if not _optimizable(text, path):
            return
        lead, core, trail = _split_ws(text)
        self.containers.append(Container(path=path, text=text, whole=True, item=item))
        self.documents.append(
            Found(
                text=core,
                title=title,
                container=len(self.containers) - 1,
                end=len(text),
                lead=lead,
                trail=trail,
                required=required,
            )
        )

    def add_extension(self, ext_docs: list[Document]) -> None:
        """The documents of the ``rag_opt`` field (rendered as blocks by :attr:`placer`)."""
        for k, d in enumerate(ext_docs):
            if not _optimizable(d.text, (EXTENSION_FIELD, "documents", k, "text")):  # an empty one: rendered as sent
                self.extension.append(Found(text=d.text, id=d.id, title=d.title))
                continue
            extra: dict[str, Any] = {}
            if d.metadata:
                extra["metadata"] = d.metadata
            if d.score is not None:
                extra["score"] = d.score
            self.extension.append(len(self.documents))
            self.documents.append(Found(text=d.text, id=d.id, title=d.title, extra=extra))

    def set_query(self, texts: list[str]) -> None:
        """The question: the ``rag_opt.query`` option, else ``texts`` (those of the last user message) joined by
        newlines with their blocks removed; None when empty. With documents to optimize, a question holding a lone
        surrogate is refused (:func:`~rag_opt.wire.request.lone_surrogate`: it is read, as they are)."""
        if self.options.query is not None:
            self.query = self.options.query
        elif texts:
            question = _BLANKS.sub(_one_newline, "\n".join(strip_blocks(t, self.tag) for t in texts)).strip()
            self.query = question or None
        if self.query is not None and self.documents and has_lone_surrogate(self.query):
            raise lone_surrogate("the question (the last user message's text)", None)

    def optimizer_documents(self) -> list[dict[str, Any]]:
        """The documents to pass to ``ContextOptimizer.optimize`` (index i = ``documents[i]``)."""
        return [d.as_input() for d in self.documents]

    def render(self, result: OptimizeResult | None) -> bytes:
        """The request body to forward: ``result`` written back in place (None: documents unchanged)."""
        n = len(self.documents)
        if result is None:
            order, texts = list(range(n)), {i: d.text for i, d in enumerate(self.documents)}
        else:
            order = [d.index for d in result.documents]
            texts = {d.index: d.text.strip() for d in result.documents}  # the block keeps its own spacing
            dropped = [d.index for d in result.dropped]
            if sorted(order + dropped) != list(range(n)):
                raise RewriteError(f"optimizer result does not match the {n} documents sent")
        kept = set(order)
        # each container's documents (position order) and its kept ones (output order): one pass each, so
        # rendering stays linear in the number of documents and containers
        here: list[list[int]] = [[] for _ in self.containers]
        for i, d in enumerate(self.documents):
            if d.container is not None:
                here[d.container].append(i)
        movers: list[list[int]] = [[] for _ in self.containers]
        for i in order:
            c_idx = self.documents[i].container
            if c_idx is not None:
                movers[c_idx].append(i)
        values: dict[JsonPath, str] = {}
        for c_idx, c in enumerate(self.containers):
            new = self._container_text(c, here[c_idx], movers[c_idx], kept, texts)
            if new != c.text:
                values[c.path] = new
        ext_movers = iter([i for i in order if self.documents[i].container is None])  # kept, in output order
        ext_blocks: list[str] = []
        for slot in self.extension:  # empty documents keep their place; kept ones fill the others in order
            if isinstance(slot, Found):
                ext_blocks.append(_render_block(self.tag, slot, slot.text))
            elif slot in kept:
                j = next(ext_movers)
                ext_blocks.append(_render_block(self.tag, self.documents[j], texts[j]))
        ext_text = "\n".join(ext_blocks)
        if not values and not ext_text and not self.has_extension_field:
            return self.raw
        return self._write_back(values, ext_text)

    def _write_back(self, values: dict[JsonPath, str], ext_text: str) -> bytes:
        """The original bytes with the changed message texts, the extension documents and without the
        extension field."""
        editor = JsonEditor(self.raw.decode("utf-8"))
        values = dict(values)
        edits: list[Edit] = []
        if ext_text:
            if self.placer is None:
                raise RewriteError("this request's API gives no place for the extension documents")
            edits += self.placer(self, editor, values, ext_text)
        edits += (self.remover or ContextPlan.remove_blank)(self, editor, values)
        for path, value in values.items():
            edits.append(editor.replace(path, value))
        if self.has_extension_field:
            edits += editor.remove_members(EXTENSION_FIELD)
        return editor.render(edits)

    def remove_blank(
        self, editor: JsonEditor, values: dict[JsonPath, str], removed: dict[JsonPath, list[int]] | None = None
    ) -> list[Edit]:
        """Remove the content blocks whose text became blank (their :attr:`Container.item`), keeping at least
        one block in each array; their values are taken out of ``values``. ``removed``: filled with the indexes
        removed from each array."""
        arrays: dict[JsonPath, list[tuple[int, JsonPath]]] = {}
        for c in self.containers:
            if c.item is not None and c.path in values and not values[c.path].strip() and c.text.strip():
                arrays.setdefault(c.item[:-1], []).append((int(c.item[-1]), c.path))
        edits: list[Edit] = []
        for array, blank in arrays.items():
            if editor.count_items(array) <= len(blank):
                blank = blank[1:]  # every block would go: the first stays, blank
            for _, path in blank:
                del values[path]
            edits += editor.remove_items(array, [i for i, _ in blank])
            if removed is not None and blank:
                removed[array] = [i for i, _ in blank]
        return edits

    def _container_text(
        self, c: Container, here: list[int], kept_order: list[int], kept: set[int], texts: dict[int, str]
    ) -> str:
        """The new text of ``c``, whose documents are ``here`` (position order) and its kept ones ``kept_order``
        (output order)."""
        if c.whole:
            d = self.documents[here[0]]
            if here[0] not in kept:
                return ""
            return c.text[: d.start] + d.lead + texts[here[0]] + d.trail + c.text[d.end :]
        movers = iter(kept_order)  # kept documents of this text, in output order
        edits: list[Edit] = []
        spans = [(self.documents[i].start, self.documents[i].end) for i in here]
        k = 0
        while k < len(here):
            i = here[k]
            if i in kept:
                j = next(movers)
                edits.append((*spans[k], self.documents[j].block(texts[j])))
                k += 1
                continue
            # a run of dropped blocks separated only by whitespace goes as one, with the whitespace towards a
            # neighbouring block (else the shorter whitespace run around it): the surrounding text keeps its spacing
            last = k
            while last + 1 < len(here) and here[last + 1] not in kept and _gap(c.text, spans[last], spans[last + 1]):
                last += 1
            s, e = spans[k][0], spans[last][1]
            before = len(c.text[:s]) - len(c.text[:s].rstrip())
            after = len(c.text[e:]) - len(c.text[e:].lstrip())
            next_block = last + 1 < len(here) and _gap(c.text, spans[last], spans[last + 1])
            prev_block = k > 0 and _gap(c.text, spans[k - 1], spans[k])
            if next_block or (not prev_block and after <= before):
                e += after
            else:
                s -= before
            edits.append((s, e, ""))
            k = last + 1
        return apply_edits(c.text, edits)


def _gap(text: str, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Only whitespace lies between span ``a`` and the later span ``b``."""
    return not text[a[1] : b[0]].strip()


def _render_block(tag: str, d: Found, text: str) -> str:
    attrs = "".join(f' {k}="{html.escape(v, quote=True)}"' for k, v in (("id", d.id), ("title", d.title)) if v)
    return f"<{tag}{attrs}>{text}</{tag}>"
