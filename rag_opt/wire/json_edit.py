"""Editing a JSON text in place: only the values that change are replaced, every other byte stays as it was.

:class:`JsonEditor` finds values by their path in the original text (``("messages", 3, "content")``) and turns
each change into an edit ``(start, end, replacement)`` of that text; :func:`apply_edits` applies edits. Object
keys resolve as :func:`json.loads` resolves them (the last duplicate wins), so the edited value is the one the
parsed body holds. Key order, whitespace, number formatting and escapes outside the edited values are untouched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]  # (undeclared in typeshed)
from typing import Any

from rag_opt.wire.errors import RewriteError

__all__ = ["Edit", "JsonEditor", "JsonPath", "apply_edits", "dumps"]

Edit = tuple[int, int, str]
"""Replace ``text[start:end]`` by the string."""
JsonPath = tuple[str | int, ...]
"""Object keys and array indexes from the top-level value down, e.g. ``("messages", 0, "content")``."""

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def dumps(value: Any) -> str:
    """``value`` as compact JSON text; non-ASCII characters unescaped unless they cannot be encoded as UTF-8
    (lone surrogates from ``\\ud800``-style escapes stay escaped)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, ensure_ascii=True, separators=(",", ":"))
    return text


def apply_edits(text: str, edits: Sequence[Edit]) -> str:
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


@dataclass
class _Member:
    key: str
    key_start: int
    value_start: int
    value_end: int


def _ws(s: str, i: int) -> int:
    m = _WS.match(s, i)
    return m.end() if m else i


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


def _remove_runs(spans: list[tuple[int, int]], drop: list[bool], inner_start: int, inner_end: int) -> list[Edit]:
    """Edits that delete the entries (members or items: their spans) marked in ``drop`` from a container whose
    inside is ``text[inner_start:inner_end]``, with the separators that go with them."""
    if drop and all(drop):
        return [(inner_start, inner_end, "")]  # everything between the brackets
    edits: list[Edit] = []
    k = 0
    while k < len(spans):
        if not drop[k]:
            k += 1
            continue
        run_end = k
        while run_end + 1 < len(spans) and drop[run_end + 1]:
            run_end += 1
        if run_end + 1 < len(spans):  # a kept entry follows: delete up to its start
            edits.append((spans[k][0], spans[run_end + 1][0], ""))
        else:  # the run ends the container: delete from the previous entry's end
            edits.append((spans[k - 1][1], spans[run_end][1], ""))
        k = run_end + 1
    return edits


def _where(path: JsonPath) -> str:
    return "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in path).lstrip(".")


class JsonEditor:
    """Edits of one JSON text (valid JSON: it was parsed before), by path. Objects and arrays are scanned once,
    when first reached."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._root = _ws(text, 0)
        self._objects: dict[int, tuple[list[_Member], int]] = {}
        self._arrays: dict[int, list[tuple[int, int]]] = {}

    def _object(self, start: int) -> tuple[list[_Member], int]:
        if start not in self._objects:
            self._objects[start] = _members(self.text, start)
        return self._objects[start]

    def _array(self, start: int) -> list[tuple[int, int]]:
        if start not in self._arrays:
            self._arrays[start] = _items(self.text, start)
        return self._arrays[start]

    def _start(self, path: JsonPath) -> tuple[int, int | None] | None:
        """(start, end) of the value at ``path`` (end None for the top-level value); None when absent."""
        start, end = self._root, None
        for step in path:
            if isinstance(step, str):
                if self.text[start] != "{":
                    return None
                member = _last(self._object(start)[0], step)
                if member is None:
                    return None
                start, end = member.value_start, member.value_end
            else:
                if self.text[start] != "[":
                    return None
                items = self._array(start)
                if not 0 <= step < len(items):
                    return None
                start, end = items[step]
        return start, end

    def span(self, path: JsonPath) -> tuple[int, int] | None:
        """Where the value at ``path`` is in the text (start, end); None when absent."""
        found = self._start(path)
        if found is None:
            return None
        start, end = found
        return start, end if end is not None else _DECODER.raw_decode(self.text, start)[1]

    def is_array(self, path: JsonPath) -> bool:
        """Whether the value at ``path`` exists and is an array."""
        found = self._start(path)
        return found is not None and self.text[found[0]] == "["

    def replace(self, path: JsonPath, value: Any) -> Edit:
        """Replace the value at ``path`` (which must exist) by ``value``."""
        found = self._start(path)
        if found is None or found[1] is None:
            raise RewriteError(f"{_where(path)} not found in the body")
        return found[0], found[1], dumps(value)

    def insert_first(self, path: JsonPath, value: Any) -> Edit:
        """Insert ``value`` as the first item of the array at ``path`` (see :meth:`is_array`)."""
        found = self._start(path)
        if found is None or self.text[found[0]] != "[":
            raise RewriteError(f"{_where(path) or 'the body'} is not an array")
        at = found[0] + 1
        return at, at, dumps(value) + ("," if self._array(found[0]) else "")

    def remove_members(self, key: str, path: JsonPath = ()) -> list[Edit]:
        """Remove every member named ``key`` (duplicates included) from the object at ``path``, with the
        separators that go with them."""
        found = self._start(path)
        if found is None or self.text[found[0]] != "{":
            raise RewriteError(f"{_where(path) or 'the body'} is not an object")
        members, after = self._object(found[0])
        spans = [(m.key_start, m.value_end) for m in members]
        return _remove_runs(spans, [m.key == key for m in members], found[0] + 1, after - 1)

    def insert_member(self, path: JsonPath, key: str, value: Any) -> Edit:
        """Add the member ``key: value`` last in the object at ``path`` (one that has no ``key``)."""
        found = self._start(path)
        if found is None or self.text[found[0]] != "{":
            raise RewriteError(f"{_where(path) or 'the body'} is not an object")
        members, _ = self._object(found[0])
        member = dumps(key) + ":" + dumps(value)
        if members:
            at = members[-1].value_end
            return at, at, "," + member
        return found[0] + 1, found[0] + 1, member

    def count_items(self, path: JsonPath) -> int:
        """How many items the array at ``path`` has (0 when it is absent or not an array)."""
        found = self._start(path)
        return len(self._array(found[0])) if found is not None and self.text[found[0]] == "[" else 0

    def remove_items(self, path: JsonPath, indexes: Sequence[int]) -> list[Edit]:
        """Remove the items at ``indexes`` from the array at ``path``, with the separators that go with them."""
        found = self._start(path)
        if found is None or self.text[found[0]] != "[":
            raise RewriteError(f"{_where(path) or 'the body'} is not an array")
        items = self._array(found[0])
        close = items[-1][1] if items else found[0] + 1
        close = _ws(self.text, close)  # the ']'
        return _remove_runs(items, [i in set(indexes) for i in range(len(items))], found[0] + 1, close)

    def render(self, edits: Sequence[Edit]) -> bytes:
        """The text with ``edits`` applied, as UTF-8."""
        return apply_edits(self.text, edits).encode("utf-8")
