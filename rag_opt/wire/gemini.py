"""The Gemini API (``POST /v1beta/models/{model}:generateContent`` and ``:streamGenerateContent``): a request body
read, its context found.

The same routes under ``tunedModels/`` and under ``/v1`` (the google-genai SDK's default API version) are these
routes too (:func:`rag_opt.server.paths.gemini_route`); they are forwarded to ``--gemini-upstream`` with the path
as it came. The body's fields are read in both spellings the API accepts (``systemInstruction`` or
``system_instruction``, ``functionResponse`` or ``function_response``; both in one object is a 400), and a
``parts`` that is one part object rather than an array is read as that one part, as the API reads it.

A content without ``role`` is a ``user`` content (as the API reads a single turn). The question is the text of
the last ``user`` content that has text (its ``text`` parts joined by newlines, document blocks removed; a
``thought`` part is not text), unless ``rag_opt.query`` gives one; that content and the contents after it are the
current turn. Context is:

1. ``<document ...>...</document>`` blocks (the tag is ``--document-tag``) in the ``text`` parts of
   ``systemInstruction`` and of the current turn's ``user`` contents, as on the chat route;
2. ``functionResponse`` parts of the current turn (in ``user`` or ``function`` contents): every string value in
   their ``response`` object, at any depth, is read as a tool result is on the other routes — its
   ``<document>`` blocks, or, without any, the whole string as one document when at least
   ``--tool-min-chars`` long (unless ``--no-tool-messages``), never emptied. Object keys, numbers and the rest
   of the JSON stay as they are (so the response stays the same JSON object, its strings shorter);
3. ``rag_opt.documents``: rendered as blocks in a new first ``text`` part of the question's content (before its
   text when its ``parts`` is one text part), or with ``"placement": "system"`` at the end of the last text part
   of ``systemInstruction`` (a new ``systemInstruction`` when there is none). The ``rag_opt`` field is removed
   before forwarding.

Everything else is forwarded byte for byte (:meth:`rag_opt.wire.documents.ContextPlan.render`), except that a
``text`` part the optimization leaves blank is not sent: the API refuses an empty text part (its ``data`` oneof
is then unset), so such a part is removed from its ``parts``. When every part of ``systemInstruction`` would go,
the ``systemInstruction`` is removed (a system instruction of nothing is none); when every part of a content
would go (its text was all dropped documents), the request is forwarded unoptimized rather than with an empty
content (fail-open, reason ``error``). The flow is :class:`rag_opt.wire.flow.RequestFlow`; on ``rag-opt serve``
(:class:`rag_opt.server.routes.GeminiContent`) rag-opt's own errors come in Google's shape (``{"error": {"code",
"message", "status"}}``), ``--gemini-upstream-api-key`` is sent as ``x-goog-api-key``
(:mod:`rag_opt.server.upstream`), and the model, for ``/stats``, is the one the path names.
Nothing is scored, selected or ordered here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from rag_opt.wire.documents import ContextPlan
from rag_opt.wire.errors import RequestError, RewriteError
from rag_opt.wire.json_edit import Edit, JsonEditor, JsonPath
from rag_opt.wire.request import EXTENSION_FIELD, check_unique, json_type, parse_request
from rag_opt.wire.settings import WireSettings

__all__ = ["FUNCTION_RESPONSE_KEYS", "SYSTEM_KEYS", "check_gemini_body", "plan_gemini"]

SYSTEM_KEYS = ("systemInstruction", "system_instruction")
FUNCTION_RESPONSE_KEYS = ("functionResponse", "function_response")
_BODY_KEYS = frozenset({"contents", *SYSTEM_KEYS, EXTENSION_FIELD})
_CONTENT_KEYS = frozenset({"role", "parts"})
_PART_KEYS = frozenset({"text", "thought", *FUNCTION_RESPONSE_KEYS})
_TOOL_ROLES = ("user", "function")  # function responses come in user contents (formerly "function" ones)


def _one_of(obj: dict[str, Any], keys: tuple[str, ...], where: str) -> str | None:
    """The key of ``keys`` (two spellings of one field) that ``obj`` has; both is a 400."""
    present = [k for k in keys if k in obj]
    if len(present) > 1:
        param = f"{where}.{present[0]}" if where else present[0]
        raise RequestError(
            f"{param} is sent twice, as {' and '.join(present)}: send it once (rag-opt and the upstream could read "
            "different values)",
            param,
            "duplicate_key",
        )
    return present[0] if present else None


def _check_content(content: Any, where: str) -> None:
    if not isinstance(content, dict):
        raise RequestError(f"{where} must be a Content object, got {json_type(content)}", where, "invalid_type")
    check_unique(content, where, _CONTENT_KEYS)
    role = content.get("role")
    if role is not None and not isinstance(role, str):
        raise RequestError(f"{where}.role must be a string, got {json_type(role)}", f"{where}.role", "invalid_type")
    parts = content.get("parts")
    if parts is None:
        return
    if isinstance(parts, dict):
        _check_part(parts, f"{where}.parts")
    elif isinstance(parts, list):
        for j, part in enumerate(parts):
            _check_part(part, f"{where}.parts[{j}]")
    else:
        raise RequestError(
            f"{where}.parts must be an array of Part objects, got {json_type(parts)}", f"{where}.parts", "invalid_type"
        )


def _check_part(part: Any, where: str) -> None:
    if not isinstance(part, dict):
        raise RequestError(f"{where} must be a Part object, got {json_type(part)}", where, "invalid_type")
    check_unique(part, where, _PART_KEYS)
    if "text" in part and not isinstance(part["text"], str):
        raise RequestError(
            f"{where}.text must be a string, got {json_type(part['text'])}", f"{where}.text", "invalid_type"
        )
    key = _one_of(part, FUNCTION_RESPONSE_KEYS, where)
    if key is None:
        return
    fr = part[key]
    if not isinstance(fr, dict):
        raise RequestError(f"{where}.{key} must be an object, got {json_type(fr)}", f"{where}.{key}", "invalid_type")
    check_unique(fr, f"{where}.{key}", frozenset({"response"}))
    if "response" in fr and not isinstance(fr["response"], dict):
        raise RequestError(
            f"{where}.{key}.response must be a JSON object, got {json_type(fr['response'])}",
            f"{where}.{key}.response",
            "invalid_type",
        )


def check_gemini_body(body: dict[str, Any]) -> None:
    """The structure rag-opt reads: ``contents`` (an array of Content objects: a string ``role`` when present, a
    ``parts`` array of Part objects — or one Part object — whose ``text`` is a string and whose
    ``functionResponse`` is an object with an object ``response``) and a ``systemInstruction`` that is absent or
    a Content object. The rest is the upstream's to validate."""
    check_unique(body, "", _BODY_KEYS)
    system = _one_of(body, SYSTEM_KEYS, "")
    if "contents" not in body:
        raise RequestError("missing required parameter 'contents'", "contents", "missing_required_parameter")
    contents = body["contents"]
    if not isinstance(contents, list):
        raise RequestError(
            f"contents must be an array of Content objects, got {json_type(contents)}", "contents", "invalid_type"
        )
    for i, content in enumerate(contents):
        _check_content(content, f"contents[{i}]")
    if system is not None:
        _check_content(body[system], system)


# -- reading ------------------------------------------------------------------------------------------------------
def _role(content: dict[str, Any]) -> str:
    role = content.get("role")
    return "user" if role is None else str(role)


def _parts(content: dict[str, Any], path: JsonPath) -> Iterator[tuple[JsonPath, dict[str, Any], bool]]:
    """The parts of a content: (path, part, whether it is an item of a ``parts`` array)."""
    parts = content.get("parts")
    if isinstance(parts, dict):
        yield (*path, "parts"), parts, False
    elif isinstance(parts, list):
        for j, part in enumerate(parts):
            yield (*path, "parts", j), part, True


def _texts(content: dict[str, Any], path: JsonPath) -> list[tuple[JsonPath, str, bool]]:
    """The text parts of a content (not thoughts): (path of the text, the text, whether its part can be removed)."""
    return [
        ((*p, "text"), part["text"], in_array)
        for p, part, in_array in _parts(content, path)
        if isinstance(part.get("text"), str) and part.get("thought") is not True
    ]


def _strings(value: Any, path: JsonPath) -> list[tuple[JsonPath, str]]:
    """Every string value in a JSON value, at any depth, in document order (iterative: no recursion limit)."""
    out: list[tuple[JsonPath, str]] = []
    stack: list[tuple[JsonPath, Any]] = [(path, value)]
    while stack:
        p, v = stack.pop()
        if isinstance(v, str):
            out.append((p, v))
        elif isinstance(v, dict):
            if getattr(v, "duplicates", None):  # a key read twice: rag-opt and the upstream could differ
                check_unique(v, "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in p).lstrip("."))
            stack.extend(((*p, k), x) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend(((*p, i), x) for i, x in reversed(list(enumerate(v))))
    return out


def _asking(contents: list[Any]) -> list[int]:
    """The indexes of the ``user`` contents that have text."""
    return [i for i, c in enumerate(contents) if _role(c) == "user" and _texts(c, ())]


def plan_gemini(raw: bytes, headers: Mapping[str, str], settings: WireSettings) -> ContextPlan:
    """The context of a generateContent request body (see the module docstring); RequestError when invalid."""
    body, options, ext_docs = parse_request(raw, headers, check_gemini_body)
    plan = ContextPlan(raw=raw, body=body, tag=settings.document_tag, query=None, options=options)
    plan.has_extension_field = EXTENSION_FIELD in body
    plan.placer = _place
    plan.remover = _remove_blank
    system = _one_of(body, SYSTEM_KEYS, "")
    if system is not None:
        for path, text, removable in _texts(body[system], (system,)):
            plan.add_text(path, text, item=path[:-1] if removable else None)
    contents = body["contents"]
    asking = _asking(contents)
    turn = asking[-1] if asking else 0
    whole_min = settings.tool_min_chars if settings.tool_messages else None
    for i in range(turn, len(contents)):
        content, path = contents[i], ("contents", i)
        if _role(content) not in _TOOL_ROLES:
            continue
        if _role(content) == "user":
            for text_path, text, removable in _texts(content, path):
                plan.add_text(text_path, text, item=text_path[:-1] if removable else None)
        for part_path, part, _ in _parts(content, path):
            key = _one_of(part, FUNCTION_RESPONSE_KEYS, "")
            response = part[key].get("response") if key is not None else None
            if key is not None and isinstance(response, dict):
                for value_path, value in _strings(response, (*part_path, key, "response")):
                    plan.add_text(value_path, value, whole_min)
    plan.add_extension(ext_docs)
    plan.set_query([t for _, t, _ in _texts(contents[asking[-1]], ())] if asking else [])
    return plan


# -- writing ------------------------------------------------------------------------------------------------------
def _is_text_part(path: JsonPath) -> bool:
    """Whether ``path`` is the ``text`` of a part (of ``systemInstruction`` or of a content), not a string in a
    function response."""
    rest = path[1:] if path[0] in SYSTEM_KEYS else path[2:] if path[0] == "contents" else ()
    return rest == ("parts", "text") or (len(rest) == 3 and rest[0] == "parts" and isinstance(rest[1], int))


def _remove_blank(plan: ContextPlan, editor: JsonEditor, values: dict[JsonPath, str]) -> list[Edit]:
    """Remove the text parts left blank (see the module docstring): the whole ``systemInstruction`` when all its
    parts are; RewriteError (forwarded unoptimized) when all of a content's would be."""
    edits: list[Edit] = []
    system = _one_of(plan.body, SYSTEM_KEYS, "")
    if system is not None:
        blanked = [c for c in plan.containers if c.path[0] == system and c.path in values]
        parts = [(p, part) for p, part, _ in _parts(plan.body[system], (system,))]
        if (
            blanked
            and parts
            and all(not values.get((*p, "text"), part.get("text", "x")).strip() for p, part in parts)
            and any(c.text.strip() for c in blanked)
        ):
            for c in blanked:
                del values[c.path]
            edits += editor.remove_members(system)
    edits += plan.remove_blank(editor, values)
    for c in plan.containers:
        if c.path in values and not values[c.path].strip() and c.text.strip() and _is_text_part(c.path):
            raise RewriteError("every part of a content would be empty: forwarding the request unoptimized")
    return edits


def _place(plan: ContextPlan, editor: JsonEditor, values: dict[JsonPath, str], ext_text: str) -> list[Edit]:
    """Insert the extension documents: last in ``systemInstruction`` (``placement: "system"``), else first in the
    question's content."""
    body, part = plan.body, {"text": ext_text}
    if plan.options.placement == "system":
        system = _one_of(body, SYSTEM_KEYS, "")
        if system is None:
            return [editor.insert_member((), "systemInstruction", {"parts": [part]})]
        texts = _texts(body[system], (system,))
        if texts:
            path, text, _ = texts[-1]
            values[path] = values.get(path, text) + "\n\n" + ext_text
            return []
        if editor.is_array((system, "parts")):
            return [editor.insert_first((system, "parts"), part)]
        if "parts" not in body[system]:
            return [editor.insert_member((system,), "parts", [part])]
        raise RewriteError("no place for the documents in systemInstruction")
    contents = body["contents"]
    users = [i for i, c in enumerate(contents) if _role(c) == "user"]
    asking = _asking(contents) or users
    if asking:
        i = asking[-1]
        parts = contents[i].get("parts")
        if editor.is_array(("contents", i, "parts")):
            return [editor.insert_first(("contents", i, "parts"), part)]
        if parts is None:
            return [editor.insert_member(("contents", i), "parts", [part])]
        if isinstance(parts, dict) and isinstance(parts.get("text"), str):
            at: JsonPath = ("contents", i, "parts", "text")
            values[at] = ext_text + "\n\n" + values.get(at, str(parts["text"]))
            return []
    raise RewriteError("no user content to place the documents in")
