"""Which part of a chat completion request is context, and writing the optimized context back in place.

The question is the text of the last ``user`` message (its text parts joined by newlines, document blocks
removed), unless the request's ``rag_opt.query`` gives one. Context is, in this order:

1. ``<document ...>...</document>`` blocks (the tag is configurable; attributes such as ``id="..."`` and
   ``title="..."`` are read from the opening tag) inside ``system``/``developer`` messages, the last ``user``
   message, and ``tool``/``function`` messages after it (the current turn). A block's text between its tags
   (leading and trailing whitespace kept aside) is one document, optimized in place: kept sentences verbatim,
   dropped documents removed with their tags, and with a re-ordering, whole blocks move between the block
   positions of the same message text. An empty block (nothing but whitespace between the tags) is not a
   document: it is forwarded as it is and keeps its place.
2. ``tool``/``function`` messages of the current turn without blocks whose text is at least
   ``tool_min_chars`` long: the whole text is one document.
3. ``rag_opt.documents`` in the request's extension field: rendered as ``<document id=".." title="..">``
   blocks at the start of the last user message (``placement: "user"``, the default) or at the end of the
   first system message (``placement: "system"``); the ``rag_opt`` field is always removed before forwarding.
   Empty ones are rendered as they are, in their place, and not optimized.

A body that is not UTF-8 JSON, not an object, or whose ``messages`` are missing or malformed is a client error
(:class:`RequestError`, answered with an OpenAI-style 400); rag-opt validates only the structure it reads.

Everything else is forwarded byte for byte: the new request body is the original bytes with only the changed
JSON string values replaced (and the ``rag_opt`` member removed, the extension documents inserted), so key
order, whitespace, number formatting and escapes elsewhere are untouched. A request without context is
forwarded as the original bytes. No scoring, selecting or ordering happens here: that is
:meth:`rag_opt.ContextOptimizer.optimize`.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from json.decoder import scanstring  # type: ignore[attr-defined]  # (undeclared in typeshed)
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

EXTENSION_FIELD = "rag_opt"
HEADER_PREFIX = "x-ragopt-"
SYSTEM_ROLES = ("system", "developer")
TOOL_ROLES = ("tool", "function")


class RequestError(ValueError):
    """A client error in rag-opt's own request fields (the ``rag_opt`` field or ``x-ragopt-*`` headers)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_rag_opt") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# -- per-request options ------------------------------------------------------------------------------------
class _Extension(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    documents: list[Any] | None = None
    query: str | None = None
    ratio: float | None = None
    target_tokens: int | None = None
    threshold: float | None = None
    ordering: str | None = None
    placement: Literal["user", "system"] = "user"
    enabled: bool = True


@dataclass(frozen=True)
class Options:
    """Per-request settings: the ``rag_opt`` field over the ``x-ragopt-*`` headers; None = server default."""

    ratio: float | None = None
    target_tokens: int | None = None
    threshold: float | None = None
    ordering: str | None = None
    query: str | None = None
    placement: str = "user"
    enabled: bool = True

    @property
    def has_budget(self) -> bool:
        return any(v is not None for v in (self.ratio, self.target_tokens, self.threshold))

    def budget(self, default: Mapping[str, Any]) -> dict[str, Any]:
        """The budget for ``optimize``: this request's, else the server's default."""
        if self.has_budget:
            return {"ratio": self.ratio, "target_tokens": self.target_tokens, "threshold": self.threshold}
        return dict(default)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_HEADERS = ("ratio", "target-tokens", "threshold", "ordering", "disable")


def _check_budget(ratio: Any, target_tokens: Any, threshold: Any, where: str) -> None:
    from rag_opt.pipeline import check_budget_args

    try:
        check_budget_args(ratio, target_tokens, threshold)
    except ValueError as exc:
        raise RequestError(f"{where}: {exc}", param=where) from None


def _check_ordering(ordering: str | None, where: str) -> None:
    from rag_opt.pipeline import ORDERINGS

    if ordering is not None and ordering not in ORDERINGS:
        raise RequestError(f"{where}: unknown ordering {ordering!r}; use one of {', '.join(ORDERINGS)}", param=where)


def header_options(headers: Mapping[str, str]) -> dict[str, Any]:
    """Read the ``x-ragopt-*`` request headers (names case-insensitive); unknown ones are an error."""
    found = {
        k.lower()[len(HEADER_PREFIX) :]: v.strip() for k, v in headers.items() if k.lower().startswith(HEADER_PREFIX)
    }
    out: dict[str, Any] = {}
    for name, value in found.items():
        where = HEADER_PREFIX + name
        if name not in _HEADERS:
            raise RequestError(
                f"unknown header {where}; rag-opt reads {', '.join(HEADER_PREFIX + h for h in _HEADERS)}"
            )
        try:
            if name in ("ratio", "threshold"):
                out[name] = float(value)
            elif name == "target-tokens":
                out["target_tokens"] = int(value)
            elif name == "ordering":
                out["ordering"] = value
            elif value.lower() in _TRUE | _FALSE:
                out["enabled"] = value.lower() not in _TRUE
            else:
                raise ValueError
        except ValueError:
            raise RequestError(f"{where}: invalid value {value!r}", param=where) from None
    _check_budget(out.get("ratio"), out.get("target_tokens"), out.get("threshold"), "x-ragopt headers")
    _check_ordering(out.get("ordering"), HEADER_PREFIX + "ordering")
    return out


def _extension(value: Any) -> tuple[_Extension, list[Any]]:
    """Validate the ``rag_opt`` field; returns it and its documents as :class:`rag_opt.types.Document`."""
    if not isinstance(value, dict):
        raise RequestError(f"'{EXTENSION_FIELD}' must be an object, got {type(value).__name__}", EXTENSION_FIELD)
    try:
        ext = _Extension.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join([EXTENSION_FIELD, *map(str, err["loc"])])
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise RequestError(f"{where}: {msg}", param=where) from None
    _check_budget(ext.ratio, ext.target_tokens, ext.threshold, EXTENSION_FIELD)
    _check_ordering(ext.ordering, f"{EXTENSION_FIELD}.ordering")
    if ext.query is not None and not ext.query.strip():
        raise RequestError(f"{EXTENSION_FIELD}.query is empty", f"{EXTENSION_FIELD}.query")
    docs: list[Any] = []
    if ext.documents is not None:
        from rag_opt.types import to_documents

        try:
            docs = to_documents(ext.documents)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"{EXTENSION_FIELD}.{exc}", f"{EXTENSION_FIELD}.documents") from None
    return ext, docs


# -- documents inside message text --------------------------------------------------------------------------
@lru_cache(maxsize=16)
def block_pattern(tag: str) -> re.Pattern[str]:
    """``<tag attrs>body</tag>``, case-insensitive, non-greedy (blocks do not nest)."""
    t = re.escape(tag)
    return re.compile(rf"<{t}(?P<attrs>\s[^<>]*)?>(?P<body>.*?)</{t}\s*>", re.IGNORECASE | re.DOTALL)


_ATTR = re.compile(r"""(?P<name>[A-Za-z_:][-\w.:]*)\s*=\s*(?:"(?P<dq>[^"]*)"|'(?P<sq>[^']*)'|(?P<bare>[^\s"'=<>`]+))""")


def parse_attributes(attrs: str) -> dict[str, str]:
    """Attributes of an opening tag (HTML entities in values decoded)."""
    out: dict[str, str] = {}
    for m in _ATTR.finditer(attrs or ""):
        value = (
            m.group("dq")
            if m.group("dq") is not None
            else m.group("sq")
            if m.group("sq") is not None
            else m.group("bare")
        )
        out[m.group("name").lower()] = html.unescape(value or "")
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
                raise RuntimeError(f"optimizer result does not match the {n} documents sent")
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
        return _Rewriter(self.raw.decode("utf-8"), self.body).rewrite(
            values, ext_text, self.options.placement, self.has_extension_field
        )

    def _container_text(self, c_idx: int, c: Container, order: list[int], kept: set[int], texts: dict[int, str]) -> str:
        here = [i for i, d in enumerate(self.documents) if d.container == c_idx]  # position order
        if c.whole:
            d = self.documents[here[0]]
            if here[0] not in kept:
                return ""
            return c.text[: d.start] + d.lead + texts[here[0]] + d.trail + c.text[d.end :]
        movers = iter([i for i in order if i in here])  # kept documents of this text, in output order
        edits: list[tuple[int, int, str]] = []
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
        return _apply(c.text, edits)


def _gap(text: str, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Only whitespace lies between span ``a`` and the later span ``b``."""
    return not text[a[1] : b[0]].strip()


def _render_block(tag: str, d: Found, text: str) -> str:
    attrs = "".join(f' {k}="{html.escape(v, quote=True)}"' for k, v in (("id", d.id), ("title", d.title)) if v)
    return f"<{tag}{attrs}>{text}</{tag}>"


def _apply(text: str, edits: Sequence[tuple[int, int, str]]) -> str:
    """Apply non-overlapping (start, end, replacement) edits; overlapping starts are clamped."""
    out: list[str] = []
    pos = 0
    for s, e, rep in sorted(edits, key=lambda x: (x[0], x[1])):
        s = max(s, pos)
        e = max(e, s)
        out.append(text[pos:s])
        out.append(rep)
        pos = e
    out.append(text[pos:])
    return "".join(out)


def _check_messages(messages: Any) -> None:
    """The structure rag-opt relies on: ``messages`` is a list of objects with a string ``role`` and a
    ``content`` that is absent, null, a string or a list of objects (whose ``text``, for ``type: "text"``
    parts, is a string). Everything else in the request is the upstream's to validate."""
    if not isinstance(messages, list):
        raise RequestError(
            f"'messages' must be an array of message objects, got {_json_type(messages)}", "messages", "invalid_type"
        )
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object, got {_json_type(m)}", where, "invalid_type")
        if "role" not in m:
            raise RequestError(f"{where}.role is missing", f"{where}.role", "missing_required_parameter")
        if not isinstance(m["role"], str):
            raise RequestError(
                f"{where}.role must be a string, got {_json_type(m['role'])}", f"{where}.role", "invalid_type"
            )
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(
                f"{where}.content must be a string, an array of content parts or null, got {_json_type(content)}",
                f"{where}.content",
                "invalid_type",
            )
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise RequestError(f"{pwhere} must be an object, got {_json_type(part)}", pwhere, "invalid_type")
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise RequestError(
                    f"{pwhere}.text must be a string, got {_json_type(part.get('text'))}",
                    f"{pwhere}.text",
                    "invalid_type",
                )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__  # pragma: no cover


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode a chat completion request body; :class:`RequestError` (an OpenAI-style 400) when it is not UTF-8,
    not JSON, not an object, or its ``messages`` are missing or malformed (see :func:`_check_messages`)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(
            f"the request body is not valid UTF-8 (byte {exc.start}): send JSON encoded as UTF-8",
            code="invalid_encoding",
        ) from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(
            f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    if "messages" not in body:
        raise RequestError("missing required parameter 'messages'", "messages", "missing_required_parameter")
    _check_messages(body["messages"])
    return body


def plan_request(
    raw: bytes,
    headers: Mapping[str, str],
    *,
    tag: str = "document",
    tool_messages: bool = True,
    tool_min_chars: int = 2000,
) -> ContextPlan:
    """Find the context of a chat completion request body.

    Raises :class:`RequestError` for a body that is not a valid chat completion request (see
    :func:`parse_body`), an invalid ``rag_opt`` field or ``x-ragopt-*`` header.
    """
    opts = header_options(headers)
    body = parse_body(raw)
    ext_docs: list[Any] = []
    has_ext = EXTENSION_FIELD in body
    if has_ext:
        ext, ext_docs = _extension(body[EXTENSION_FIELD])
        if ext.ratio is not None or ext.target_tokens is not None or ext.threshold is not None:
            for k in ("ratio", "target_tokens", "threshold"):
                opts.pop(k, None)
        opts.update(ext.model_dump(exclude={"documents"}, exclude_unset=True, exclude_none=True))
    options = Options(**opts)

    pattern = block_pattern(tag)
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
            blocks = [b for b in pattern.finditer(text) if b.group("body").strip()]
            if blocks:
                plan.containers.append(Container(message=i, part=part, text=text))
                for b in blocks:
                    attrs = parse_attributes(b.group("attrs") or "")
                    lead, core, trail = _split_ws(b.group("body"))
                    plan.documents.append(
                        Found(
                            text=core,
                            id=attrs.get("id"),
                            title=attrs.get("title") or None,
                            container=len(plan.containers) - 1,
                            start=b.start(),
                            end=b.end(),
                            open_tag=text[b.start() : b.start("body")],
                            close_tag=text[b.end("body") : b.end()],
                            lead=lead,
                            trail=trail,
                        )
                    )
            elif is_tool and tool_messages and len(text.strip()) >= tool_min_chars:
                lead, core, trail = _split_ws(text)
                plan.containers.append(Container(message=i, part=part, text=text, whole=True))
                plan.documents.append(
                    Found(text=core, container=len(plan.containers) - 1, start=0, end=len(text), lead=lead, trail=trail)
                )
    for d in ext_docs:
        if not d.text.strip():  # an empty document is forwarded as it is, not optimized
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
        parts = [pattern.sub("", t) for _, t in _texts(messages[last_user].get("content"))]
        question = re.sub(r"\s*\n\s*", "\n", "\n".join(parts)).strip()
        plan.query = question or None
    return plan


# -- editing the JSON text in place -------------------------------------------------------------------------
_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _ws(s: str, i: int) -> int:
    m = _WS.match(s, i)
    return m.end() if m else i


@dataclass
class _Member:
    key: str
    key_start: int
    value_start: int
    value_end: int


def _members(s: str, i: int) -> tuple[list[_Member], int]:
    """Members of the JSON object starting at ``s[i] == '{'``, and the index after its ``}``."""
    out: list[_Member] = []
    i = _ws(s, i + 1)
    if s[i] == "}":
        return out, i + 1
    while True:
        key_start = i
        key, i = scanstring(s, i + 1)
        i = _ws(s, _ws(s, i) + 1)  # past ':'
        _, end = _DECODER.raw_decode(s, i)
        out.append(_Member(key, key_start, i, end))
        i = _ws(s, end)
        if s[i] == ",":
            i = _ws(s, i + 1)
            continue
        return out, i + 1


def _items(s: str, i: int) -> list[tuple[int, int]]:
    """(start, end) of the items of the JSON array starting at ``s[i] == '['``."""
    out: list[tuple[int, int]] = []
    i = _ws(s, i + 1)
    if s[i] == "]":
        return out
    while True:
        _, end = _DECODER.raw_decode(s, i)
        out.append((i, end))
        i = _ws(s, end)
        if s[i] == ",":
            i = _ws(s, i + 1)
            continue
        return out


def _last(members: list[_Member], key: str) -> _Member | None:
    found = [m for m in members if m.key == key]  # json.loads keeps the last duplicate: so do we
    return found[-1] if found else None


def _dumps(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (from \\ud800-style escapes): keep them escaped
        text = json.dumps(value, ensure_ascii=True, separators=(",", ":"))
    return text


class _Rewriter:
    """Replaces JSON string values of messages in the raw body text, leaving every other byte as it was."""

    def __init__(self, text: str, body: dict[str, Any]) -> None:
        self.s = text
        self.body = body
        start = _ws(text, 0)
        self.top, _ = _members(text, start)
        self.top_start = start
        msgs = _last(self.top, "messages")
        self.messages: list[tuple[int, int]] = []
        self.messages_start: int | None = None
        if msgs is not None and text[msgs.value_start] == "[":
            self.messages_start = msgs.value_start
            self.messages = _items(text, msgs.value_start)

    def _content(self, message: int) -> _Member | None:
        start, _ = self.messages[message]
        if self.s[start] != "{":
            return None
        return _last(_members(self.s, start)[0], "content")

    def _string_span(self, message: int, part: int | None) -> tuple[int, int]:
        content = self._content(message)
        if content is None:
            raise RuntimeError(f"messages[{message}].content not found in the body")
        if part is None:
            return content.value_start, content.value_end
        start, _ = _items(self.s, content.value_start)[part]
        text = _last(_members(self.s, start)[0], "text")
        if text is None:
            raise RuntimeError(f"messages[{message}].content[{part}].text not found in the body")
        return text.value_start, text.value_end

    def rewrite(
        self, values: dict[tuple[int, int | None], str], ext_text: str, placement: str, remove_field: bool
    ) -> bytes:
        edits: list[tuple[int, int, str]] = []
        values = dict(values)
        if ext_text:
            edits += self._place(values, ext_text, placement)
        for (message, part), value in values.items():
            s, e = self._string_span(message, part)
            edits.append((s, e, _dumps(value)))
        if remove_field:
            edits += self._remove_members(EXTENSION_FIELD)
        return _apply(self.s, edits).encode("utf-8")

    def _place(
        self, values: dict[tuple[int, int | None], str], ext_text: str, placement: str
    ) -> list[tuple[int, int, str]]:
        """Insert the extension documents; string contents go through ``values``, the rest are edits."""
        msgs = self.body.get("messages")
        msgs = msgs if isinstance(msgs, list) else []
        roles = [m.get("role") if isinstance(m, dict) else None for m in msgs]
        if placement == "user" and "user" in roles:
            i = len(roles) - 1 - roles[::-1].index("user")
            content = msgs[i].get("content")
            if isinstance(content, str):
                values[(i, None)] = ext_text + "\n\n" + values.get((i, None), content)
                return []
            if isinstance(content, list):
                member = self._content(i)
                if member is not None and self.s[member.value_start] == "[":
                    sep = "," if content else ""
                    return [
                        (
                            member.value_start + 1,
                            member.value_start + 1,
                            _dumps({"type": "text", "text": ext_text}) + sep,
                        )
                    ]
        if placement == "system":
            for i, role in enumerate(roles):
                if role in SYSTEM_ROLES and isinstance(msgs[i].get("content"), str):
                    values[(i, None)] = values.get((i, None), msgs[i]["content"]) + "\n\n" + ext_text
                    return []
        if self.messages_start is None:
            raise RuntimeError("no messages to place the documents in")
        sep = "," if self.messages else ""
        new = _dumps({"role": "system", "content": ext_text}) + sep
        return [(self.messages_start + 1, self.messages_start + 1, new)]

    def _remove_members(self, key: str) -> list[tuple[int, int, str]]:
        members = self.top
        drop = [m.key == key for m in members]
        if all(drop):
            close = self.s.rindex("}")
            return [(self.top_start + 1, close, "")]
        edits: list[tuple[int, int, str]] = []
        k = 0
        while k < len(members):
            if not drop[k]:
                k += 1
                continue
            run_end = k
            while run_end + 1 < len(members) and drop[run_end + 1]:
                run_end += 1
            if run_end + 1 < len(members):  # a kept member follows: delete up to its key
                edits.append((members[k].key_start, members[run_end + 1].key_start, ""))
            else:  # the run ends the object: delete from the previous member's end
                edits.append((members[k - 1].value_end, members[run_end].value_end, ""))
            k = run_end + 1
        return edits
