"""The Anthropic Messages API (``POST /v1/messages``): a request body read, its context found.

The question is the text of the last ``user`` message that has text (its ``text`` blocks, or its string
content, joined by newlines with document blocks removed), unless ``rag_opt.query`` gives one; that message and
the ``user`` messages after it (which carry tool results) are the current turn. Context is:

1. ``<document ...>...</document>`` blocks (the tag is ``--document-tag``) in the ``system`` prompt (a string or
   ``text`` blocks) and in the text of the current turn's user messages, as on the chat route;
2. ``document`` content blocks of the current turn with a text source (``"source": {"type": "text", "data":
   ...}``): the whole ``data`` is one document, titled by the block's ``title``;
3. ``tool_result`` blocks of the current turn: their ``<document>`` blocks, or, without any, their whole text
   (a string ``content`` or each of its ``text`` blocks) when at least ``--tool-min-chars`` long (unless
   ``--no-tool-messages``);
4. ``rag_opt.documents``: rendered as blocks first in the question's message (a new first ``text`` block when
   its content is a list), or with ``"placement": "system"`` at the end of a string ``system`` prompt.

Everything else is forwarded byte for byte (:meth:`rag_opt.wire.documents.ContextPlan.render`), except that a
content block whose text the optimization leaves blank (a ``text`` block that held only dropped documents, a
dropped ``document`` block) is removed rather than sent empty, which the API refuses; one block per list stays.
Removing a block keeps what the API reads from block positions intact (:func:`remove_blank`):

- a removed block's ``cache_control`` breakpoint moves to the nearest kept block of its list (the one before it,
  else the one after it) unless that one has its own, so the cached prefix still ends where it did;
- when any ``document`` block of the request has citations on (``"citations": {"enabled": true}``), a dropped
  ``document`` block is not removed but kept with :data:`PLACEHOLDER` as its text, so every document keeps its
  ``document_index``.
The flow is :class:`rag_opt.wire.flow.RequestFlow`; on ``rag-opt serve``
(:class:`rag_opt.server.routes.AnthropicMessages`) rag-opt's own errors come in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``), and ``--upstream-api-key`` is sent as ``x-api-key``.
Nothing is scored, selected or ordered here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rag_opt.wire.documents import ContextPlan, place_first, texts_of
from rag_opt.wire.errors import RequestError, RewriteError
from rag_opt.wire.json_edit import Edit, JsonEditor, JsonPath
from rag_opt.wire.request import EXTENSION_FIELD, check_messages, check_parts, check_unique, json_type, parse_request
from rag_opt.wire.settings import WireSettings

__all__ = ["PLACEHOLDER", "check_messages_body", "plan_messages", "remove_blank"]

_BODY_KEYS = frozenset({"messages", "system", EXTENSION_FIELD})
PLACEHOLDER = "(omitted)"  # the text of a dropped document block kept for its citation index


def check_messages_body(body: dict[str, Any]) -> None:
    """The structure rag-opt reads: ``messages`` (objects with a string ``role``; a string or block-list
    ``content`` whose ``text`` blocks have a string ``text``) and a ``system`` that is absent, a string or a list
    of blocks. The rest is the upstream's to validate."""
    check_unique(body, "", _BODY_KEYS)
    if "messages" not in body:
        raise RequestError("missing required parameter 'messages'", "messages", "missing_required_parameter")
    check_messages(body["messages"])
    system = body.get("system")
    if isinstance(system, list):
        check_parts(system, "system")
    elif system is not None and not isinstance(system, str):
        raise RequestError(
            f"system must be a string or an array of text blocks, got {json_type(system)}", "system", "invalid_type"
        )


def _has_text(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "user" and bool(texts_of(message.get("content"), ()))


def _tool_texts(block: dict[str, Any], path: JsonPath) -> list[tuple[JsonPath, str]]:
    return texts_of(block.get("content"), (*path, "content"))


def _block(path: JsonPath) -> JsonPath | None:
    """The content block a text at ``path`` belongs to (``...[j].text`` -> ``...[j]``); None for a string."""
    return path[:-1] if path[-1] == "text" else None


def _text_source(block: dict[str, Any]) -> str | None:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "text" and isinstance(source.get("data"), str):
        return str(source["data"])
    return None


def plan_messages(raw: bytes, headers: Mapping[str, str], settings: WireSettings) -> ContextPlan:
    """The context of a Messages API request body (see the module docstring); RequestError when invalid."""
    body, options, ext_docs = parse_request(raw, headers, check_messages_body)
    plan = ContextPlan(raw=raw, body=body, tag=settings.document_tag, query=None, options=options)
    plan.has_extension_field = EXTENSION_FIELD in body
    plan.placer = _place
    plan.remover = remove_blank
    for system_path, text in texts_of(body.get("system"), ("system",)):
        plan.add_text(system_path, text, item=_block(system_path))
    messages = body["messages"]
    asking = [i for i, m in enumerate(messages) if _has_text(m)]
    turn = asking[-1] if asking else 0
    whole_min = settings.tool_min_chars if settings.tool_messages else None
    for i in range(turn, len(messages)):
        m = messages[i]
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            plan.add_text(("messages", i, "content"), content)
            continue
        for j, block in enumerate(content if isinstance(content, list) else []):
            path = ("messages", i, "content", j)
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                plan.add_text((*path, "text"), block["text"], item=path)
            elif kind == "document" and (data := _text_source(block)) is not None:
                title = block.get("title") if isinstance(block.get("title"), str) else None
                plan.add_whole((*path, "source", "data"), data, title or None, item=path)
            elif kind == "tool_result":
                for tool_path, text in _tool_texts(block, path):
                    plan.add_text(tool_path, text, whole_min, _block(tool_path))
    plan.add_extension(ext_docs)
    plan.set_query([t for _, t in texts_of(messages[asking[-1]].get("content"), ())] if asking else [])
    return plan


def _at(body: Any, path: JsonPath) -> Any:
    for step in path:
        body = body[step]
    return body


def _citations_on(body: dict[str, Any]) -> bool:
    """Whether a ``document`` block of the messages (or of a tool result in them) has citations enabled."""
    blocks: list[Any] = []
    for m in body["messages"]:
        content = m.get("content")
        for block in content if isinstance(content, list) else []:
            blocks.append(block)
            inner = block.get("content") if block.get("type") == "tool_result" else None
            blocks += inner if isinstance(inner, list) else []
    return any(
        isinstance(b, dict)
        and b.get("type") == "document"
        and isinstance(b.get("citations"), dict)
        and b["citations"].get("enabled") is True
        for b in blocks
    )


def remove_blank(plan: ContextPlan, editor: JsonEditor, values: dict[JsonPath, str]) -> list[Edit]:
    """Remove the content blocks left blank, keeping cache breakpoints and citation indexes (see the module
    docstring)."""
    if _citations_on(plan.body):
        for c in plan.containers:
            blank = c.path in values and not values[c.path].strip() and c.text.strip()
            if blank and c.item is not None and _at(plan.body, c.item).get("type") == "document":
                values[c.path] = PLACEHOLDER
    removed: dict[JsonPath, list[int]] = {}
    edits = plan.remove_blank(editor, values, removed)
    for array, indexes in removed.items():
        items, gone = _at(plan.body, array), set(indexes)
        if not any("cache_control" in items[r] for r in indexes):
            continue
        kept = [j for j in range(len(items)) if j not in gone and isinstance(items[j], dict)]
        marks: dict[int, Any] = {}  # kept block index: the breakpoint it takes over
        k = 0  # kept[k] is the first kept block after r
        for r in sorted(indexes):
            while k < len(kept) and kept[k] < r:
                k += 1
            mark = items[r].get("cache_control")
            target = kept[k - 1] if k > 0 else kept[k] if k < len(kept) else None
            if mark is not None and target is not None and "cache_control" not in items[target]:
                marks.setdefault(target, mark)
        edits += [editor.insert_member((*array, j), "cache_control", mark) for j, mark in marks.items()]
    return edits


def _place(plan: ContextPlan, editor: JsonEditor, values: dict[JsonPath, str], ext_text: str) -> list[Edit]:
    """Insert the extension documents: at the end of a string ``system`` prompt (``placement: "system"``), else
    first in the question's message."""
    system = plan.body.get("system")
    if plan.options.placement == "system" and isinstance(system, str):
        values[("system",)] = values.get(("system",), system) + "\n\n" + ext_text
        return []
    messages = plan.body["messages"]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    asking = [i for i in users if _has_text(messages[i])] or users
    if asking:
        i = asking[-1]
        placed = place_first(editor, values, ("messages", i, "content"), messages[i].get("content"), "text", ext_text)
        if placed is not None:
            return placed
    raise RewriteError("no user message to place the documents in")
