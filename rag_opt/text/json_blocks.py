"""Finding a JSON value that starts a line (a protected block of the segmentation), in linear time overall."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

__all__ = ["json_block_end"]

_JSON_DECODER = json.JSONDecoder()
_JSON_OPENER = re.compile(r"[\[{]")


def json_block_end(text: str, lines: Sequence[tuple[int, int]], i: int) -> tuple[int | None, int]:
    """Detect a JSON block starting on line ``i``.

    Returns the index of the block's last line (None if there is no JSON value starting the line, or if
    something follows it on its last line) and the offset where a failed parse stopped (-1 otherwise), so
    the caller can skip lines a failed multi-line parse already went through.
    """
    line_start, line_end = lines[i]
    line = text[line_start:line_end]
    stripped = line.lstrip()
    if not stripped or stripped[0] not in "{[":
        return None, -1
    start = line_start + (len(line) - len(stripped))
    try:
        # The C scanner parses exactly one value from ``start`` and stops at its end (or at the first error),
        # which is the balanced extent of the block; strict mode rejects raw newlines inside strings.
        end, failed_at = _decode_end(text, start)
    except json.JSONDecodeError as exc:
        return None, exc.pos
    except RecursionError:
        # Nested deeper than the interpreter allows: not a block worth protecting. The parse got past at least
        # a few hundred openers; report the offset of the last of those as covered.
        covered = -1
        for covered_count, m in enumerate(_JSON_OPENER.finditer(text, start), start=1):
            covered = m.start()
            if covered_count >= 500:
                break
        return None, covered
    except ValueError:
        return None, -1
    if end is None:
        return None, failed_at
    j = i
    while lines[j][1] < end:
        j += 1
    if text[end : lines[j][1]].strip():
        return None, -1
    return j, -1


_PROBE_CHARS = 512


def _decode_end(text: str, start: int) -> tuple[int | None, int]:
    """End offset of the JSON value at ``start``. A failed parse builds its error message by counting newlines
    from the start of the string it was given, so parsing the whole text at every line that opens with ``{`` or
    ``[`` would be quadratic: parse a short piece first, and the whole text only when the piece ends inside the
    value (a value that ends within the piece, or a syntax error well inside it, is the same in the whole text).
    Returns ``(end, -1)``, or ``(None, offset where the parse failed)``."""
    piece = text[start : start + _PROBE_CHARS]
    try:
        return start + _JSON_DECODER.raw_decode(piece)[1], -1
    except json.JSONDecodeError as exc:
        whole = len(text) - start <= _PROBE_CHARS
        truncated = exc.pos >= len(piece) - 16 or exc.msg.startswith("Unterminated")
        if whole or not truncated:
            return None, start + exc.pos
    return int(_JSON_DECODER.raw_decode(text, start)[1]), -1
