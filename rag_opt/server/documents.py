"""Which part of a chat completion request is context, and writing the optimized context back in place.

The question is the text of the last ``user`` message (its text parts joined by newlines, document blocks
removed), unless the request's ``rag_opt.query`` gives one. Context is, in this order:

1. ``<document ...>...</document>`` blocks (the tag is configurable; attributes such as ``id="..."`` and
   ``title="..."`` are read from the opening tag) inside ``system``/``developer`` messages, the last ``user``
   message, and ``tool``/``function`` messages after it (the current turn). A block's text between its tags
   (leading and trailing whitespace kept aside) is one document, optimized in place: kept sentences verbatim,
   dropped documents removed with their tags, and with a re-ordering, whole blocks move between the block
   positions of the same message text. An empty block (nothing but whitespace between the tags) is not a
   document: it is forwarded as it is and keeps its place; so is a block holding a lone UTF-16 surrogate (a
   ``\\ud800``-style escape), which cannot be encoded for the optimizer. Blocks are found by
   :func:`rag_opt.server.markup.scan` in linear time: quoted attribute values may contain ``>``; with nested
   blocks, the innermost ones are the documents and the tags around them stay as they are; unmatched tags are
   text.
2. ``tool``/``function`` messages of the current turn without blocks whose text is at least
   ``tool_min_chars`` long: the whole text is one document.
3. ``rag_opt.documents`` in the request's extension field: rendered as ``<document id=".." title="..">``
   blocks at the start of the last user message (``placement: "user"``, the default) or at the end of the
   first system message (``placement: "system"``); the ``rag_opt`` field is always removed before forwarding.
   Empty ones are rendered as they are, in their place, and not optimized.

The request itself is read and validated by :mod:`rag_opt.server.request`. Everything else is forwarded byte
for byte: the new request body is the original bytes with only the changed JSON string values replaced (and the
``rag_opt`` member removed, the extension documents inserted; :mod:`rag_opt.server.json_edit`), so key order,
whitespace, number formatting and escapes elsewhere are untouched. A request without context is forwarded as
the original bytes. No scoring, selecting or ordering happens here: that is
:meth:`rag_opt.ContextOptimizer.optimize`.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rag_opt.server.errors import RewriteError
from rag_opt.server.json_edit import Edit, JsonEditor, JsonPath, apply_edits
from rag_opt.server.markup import parse_attributes, scan, strip_blocks
from rag_opt.server.request import EXTENSION_FIELD, Options, parse_request

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = [
    "SYSTEM_ROLES",
    "TOOL_ROLES",
    "Container",
    "ContextPlan",
    "Found",
    "has_lone_surrogate",
    "parse_attributes",
    "plan_request",
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
    be encoded, so such a document is passed through as it is instead of being optimized."""
    return _SURROGATE.search(text) is not None


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

    def as_input(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"text": self.text, **self.extra}
        if self.id is not None:
            doc["id"] = self.id
        if self.title is not None:
            doc["title"] = self.title
        return doc

    def block(self, text: str) -> str:
        return self.open_tag + self.lead + text + self.trail + self.close_tag


@dataclass
class Container:
    """A JSON string that holds documents: ``messages[message].content`` or ``...content[part].text``."""

    message: int
    part: int | None
    text: str
    whole: bool = False  # the whole text is one document (a large tool message)


def _optimizable(text: str) -> bool:
    """A document worth optimizing: not empty, and encodable (no lone surrogate)."""
    return bool(text.strip()) and not has_lone_surrogate(text)


def _split_ws(body: str) -> tuple[str, str, str]:
    core = body.strip()
    if not core:
        return body, "", ""
    lead = body[: len(body) - len(body.lstrip())]
    trail = body[len(body.rstrip()) :]
    return lead, core, trail


def _texts(content: Any) -> list[tuple[int | None, str]]:
    if isinstance(content, str):
        return [(None, content)]
    if isinstance(content, list):
        return [
            (j, p["text"])
            for j, p in enumerate(content)
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        ]
    return []


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
        values: dict[tuple[int, int | None], str] = {}
        for c_idx, c in enumerate(self.containers):
            new = self._container_text(c_idx, c, order, kept, texts)
            if new != c.text:
                values[(c.message, c.part)] = new
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

    def _write_back(self, values: dict[tuple[int, int | None], str], ext_text: str) -> bytes:
        """The original bytes with the changed message texts, the extension documents and without the
        extension field."""
        editor = JsonEditor(self.raw.decode("utf-8"))
        values = dict(values)
        edits: list[Edit] = []
        if ext_text:
            edits += self._place(editor, values, ext_text)
        for (message, part), value in values.items():
            edits.append(editor.replace(_text_path(message, part), value))
        if self.has_extension_field:
            edits += editor.remove_members(EXTENSION_FIELD)
        return editor.render(edits)

    def _place(self, editor: JsonEditor, values: dict[tuple[int, int | None], str], ext_text: str) -> list[Edit]:
        """Insert the extension documents; string contents go through ``values``, the rest are edits."""
        msgs = self.body.get("messages")
        msgs = msgs if isinstance(msgs, list) else []
        roles = [m.get("role") if isinstance(m, dict) else None for m in msgs]
        if self.options.placement == "user" and "user" in roles:
            i = len(roles) - 1 - roles[::-1].index("user")
            content = msgs[i].get("content")
            if isinstance(content, str):
                values[(i, None)] = ext_text + "\n\n" + values.get((i, None), content)
                return []
            if isinstance(content, list) and editor.is_array(("messages", i, "content")):
                return [editor.insert_first(("messages", i, "content"), {"type": "text", "text": ext_text})]
        if self.options.placement == "system":
            for i, role in enumerate(roles):
                if role in SYSTEM_ROLES and isinstance(msgs[i].get("content"), str):
                    values[(i, None)] = values.get((i, None), msgs[i]["content"]) + "\n\n" + ext_text
                    return []
        if not editor.is_array(("messages",)):
            raise RewriteError("no messages to place the documents in")
        return [editor.insert_first(("messages",), {"role": "system", "content": ext_text})]

    def _container_text(self, c_idx: int, c: Container, order: list[int], kept: set[int], texts: dict[int, str]) -> str:
        here = [i for i, d in enumerate(self.documents) if d.container == c_idx]  # position order
        if c.whole:
            d = self.documents[here[0]]
            if here[0] not in kept:
                return ""
            return c.text[: d.start] + d.lead + texts[here[0]] + d.trail + c.text[d.end :]
        movers = iter([i for i in order if i in here])  # kept documents of this text, in output order
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


def _text_path(message: int, part: int | None) -> JsonPath:
    """Where a message text is: ``messages[message].content`` or ``...content[part].text``."""
    if part is None:
        return ("messages", message, "content")
    return ("messages", message, "content", part, "text")


def plan_request(
    raw: bytes,
    headers: Mapping[str, str],
    *,
    tag: str = "document",
    tool_messages: bool = True,
    tool_min_chars: int = 2000,
) -> ContextPlan:
    """Find the context of a chat completion request body.

    Raises :class:`~rag_opt.server.errors.RequestError` for a body that is not a valid chat completion request,
    an invalid ``rag_opt`` field or ``x-ragopt-*`` header (see :func:`rag_opt.server.request.parse_request`).
    """
    body, options, ext_docs = parse_request(raw, headers)
    has_ext = EXTENSION_FIELD in body

    plan = ContextPlan(raw=raw, body=body, tag=tag, query=None, options=options, has_extension_field=has_ext)
    messages = body["messages"]
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    last_user = users[-1] if users else None
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        is_tool = role in TOOL_ROLES and (last_user is None or i > last_user)
        if not (role in SYSTEM_ROLES or i == last_user or is_tool):
            continue
        for part, text in _texts(m.get("content")):
            found = scan(text, tag).documents
            blocks = [b for b in found if _optimizable(text[b.body_start : b.body_end])]
            if blocks:
                plan.containers.append(Container(message=i, part=part, text=text))
                for b in blocks:
                    lead, core, trail = _split_ws(text[b.body_start : b.body_end])
                    plan.documents.append(
                        Found(
                            text=core,
                            id=b.attrs.get("id"),
                            title=b.attrs.get("title") or None,
                            container=len(plan.containers) - 1,
                            start=b.start,
                            end=b.end,
                            open_tag=text[b.start : b.body_start],
                            close_tag=text[b.body_end : b.end],
                            lead=lead,
                            trail=trail,
                        )
                    )
            elif is_tool and tool_messages and len(text.strip()) >= tool_min_chars:
                if has_lone_surrogate(text):
                    continue
                lead, core, trail = _split_ws(text)
                plan.containers.append(Container(message=i, part=part, text=text, whole=True))
                plan.documents.append(
                    Found(text=core, container=len(plan.containers) - 1, start=0, end=len(text), lead=lead, trail=trail)
                )
    for d in ext_docs:
        if not _optimizable(d.text):  # an empty document is forwarded as it is, not optimized
            plan.extension.append(Found(text=d.text, id=d.id, title=d.title))
            continue
        extra: dict[str, Any] = {}
        if d.metadata:
            extra["metadata"] = d.metadata
        if d.score is not None:
            extra["score"] = d.score
        plan.extension.append(len(plan.documents))
        plan.documents.append(Found(text=d.text, id=d.id, title=d.title, extra=extra))

    if options.query is not None:
        plan.query = options.query
    elif last_user is not None:
        parts = [strip_blocks(t, tag) for _, t in _texts(messages[last_user].get("content"))]
        question = _BLANKS.sub(_one_newline, "\n".join(parts)).strip()
        plan.query = question or None
    if plan.query is not None and has_lone_surrogate(plan.query):  # only scored, never written back
        plan.query = _SURROGATE.sub("\ufffd", plan.query)
    return plan
