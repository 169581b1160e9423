"""The input side of ``rag-opt index``: reading corpus rows (one document per JSONL line) and tallying what became
of each."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rag_opt.cli.common import UserError
from rag_opt.inputs import has_lone_surrogate

__all__ = ["IndexSummary", "RowResult", "Status", "batches", "count_rows", "parse_row"]

logger = logging.getLogger(__name__)

Status = Literal["indexed", "cached", "failed"]


@dataclass(frozen=True)
class RowResult:
    """What became of one input row: ``indexed`` (encoded now), ``cached`` (every block was on disk already) or
    ``failed`` (``error`` says why, with the line number)."""

    line: int
    status: Status
    error: str | None = None
    blocks: int = 0  # blocks encoded for this row now


@dataclass
class IndexSummary:
    """What :func:`run_index` did."""

    indexed: int = 0
    cached: int = 0
    failed: int = 0
    blocks: int = 0  # blocks encoded (forward passes' worth)
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def add(self, result: RowResult) -> None:
        if result.status == "indexed":
            self.indexed += 1
        elif result.status == "cached":
            self.cached += 1
        else:
            self.failed += 1
            if result.error is not None:
                self.errors.append(result.error)
        self.blocks += result.blocks

    def line(self, cache_dir: str | Path) -> str:
        return (
            f"rag-opt index: indexed {self.indexed}, skipped-cached {self.cached}, failed {self.failed} "
            f"({self.blocks} blocks encoded in {self.seconds:.1f} s into {cache_dir})"
        )


# -- rows ---------------------------------------------------------------------------------------------------------
def parse_row(raw: bytes | str, line: int) -> dict[str, Any]:
    """One input line as a document ``{"text", "title"?, "metadata"?}`` (the fields the encoding reads); raises
    :class:`~rag_opt.cli.common.UserError` (``line N: why``) for a row that cannot be indexed (not UTF-8, not
    JSON, a number too long to read, nesting too deep, no text, a lone UTF-16 surrogate), and nothing else."""
    where = f"line {line}"
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise UserError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        digits = sys.get_int_max_str_digits()
        raise UserError(f"{where}: invalid JSON (a number too long to read: over {digits} digits)") from None
    if isinstance(rec, str):
        rec = {"text": rec}
    if not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object with a 'text' field or a string")
    text = rec.get("text", rec.get("page_content"))
    if not isinstance(text, str):
        raise UserError(f"{where}: missing string field 'text'")
    if not text.strip():
        raise UserError(f"{where}: the document's text is empty")
    doc: dict[str, Any] = {"text": text}
    for key in ("title", "metadata"):
        if rec.get(key) is not None:
            doc[key] = rec[key]
    if has_lone_surrogate(doc):  # not Unicode text: it cannot be encoded (nor its key hashed)
        raise UserError(f"{where}: holds a lone UTF-16 surrogate (a \\ud800-style escape without its pair)")
    return doc


def lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of every non-blank line of ``path`` (``-``: standard input)."""
    fh = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115 - closed below
    try:
        for n, raw in enumerate(fh, start=1):
            if raw.strip():
                yield n, raw.rstrip(b"\r\n")
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


def count_rows(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, "rb") as fh:
        return sum(1 for raw in fh if raw.strip())


def batches(path: str, size: int, failed: list[RowResult]) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    """Batches of ``size`` parsed rows; rows that cannot be parsed are appended to ``failed`` (a row never raises:
    its error is that row's)."""
    batch: list[tuple[int, dict[str, Any]]] = []
    for line, raw in lines(path):
        try:
            batch.append((line, parse_row(raw, line)))
        except UserError as exc:
            failed.append(RowResult(line, "failed", str(exc)))
        except (ValueError, TypeError, RecursionError, OverflowError) as exc:  # not foreseen: still this row's
            logger.debug("line %d could not be read", line, exc_info=True)
            failed.append(
                RowResult(line, "failed", f"line {line}: cannot be read as a document ({type(exc).__name__})")
            )
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
