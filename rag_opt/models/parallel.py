"""Parallel document encoding: every document read on its own, then one question pass over their caches.

The prompt is the joint one (``Documents:``, the documents separated by a blank line, ``Question: ...``,
``Answer:``), read differently:

* each document *block* (its text plus the separator after it) attends only to the shared prefix
  ``Documents:\\n`` and to itself, at positions that restart right after the prefix for every block. A block's
  key/value states therefore depend on nothing but its own tokens: they are computed once (a *document pass*,
  an ordinary causal forward of ``prefix + block``) and can be cached by content
  (:mod:`rag_opt.models.encoding_cache`);
* the question and ``Answer:`` tokens attend to the prefix, to every block and causally to themselves, at
  positions right after the longest block (the *question pass*, over the blocks' concatenated caches:
  :mod:`rag_opt.models.question_pass`). The attention rows rag-opt reads come from this pass
  (:mod:`rag_opt.models.capture`).

Blocks are tokenized as they stand in the prompt (before the text that follows them): a block is tokenized
with a fixed follower word after it and cut at its own end, so its token ids never depend on its neighbours
(tokenized alone, ``"\\n\\n"`` at the end of a text becomes one token instead of two).

Nothing here depends on the order of the documents: under parallel encoding a document's features are the same
in every slot (the proxy has no position bias over documents to calibrate).

A document longer than a block may be (``max_block_tokens``, and never past the model's positions) is split
into consecutive blocks of whole units, each encoded on its own (a later piece does not read the earlier one);
a single unit longer than that keeps its first ``max_block_tokens`` tokens (logged), the rest is not read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from rag_opt.errors import InvalidInputError
from rag_opt.models.prompt import ANSWER_SUFFIX, CONTEXT_PREFIX, DOC_SEPARATOR, QUESTION_PREFIX
from rag_opt.work import check_proxy_tokens, checkpoint

__all__ = [
    "FOLLOWER",
    "Block",
    "ParallelPrompt",
    "block_tokens",
    "context_positions",
    "parallel_prompt",
    "question_tokens",
]

logger = logging.getLogger(__name__)

FOLLOWER = "Question"  # what a block is tokenized before (the first word of the text after the last document)


@dataclass(frozen=True)
class Block:
    """One document block: its token ids (the cache key's content) and the unit of each token (-1: none)."""

    doc: int
    ids: tuple[int, ...]
    unit_of: tuple[int, ...]  # per token: the context-wide unit index, or -1 (separator)

    @property
    def ends(self) -> tuple[int, ...]:
        """Index in the block of the last token of each unit it holds, in unit order (the cross-document
        reading's sources, :mod:`rag_opt.models.parallel_cross`)."""
        last: dict[int, int] = {}
        for i, u in enumerate(self.unit_of):
            if u >= 0:
                last[u] = i
        return tuple(last[u] for u in sorted(last))


@dataclass(frozen=True)
class ParallelPrompt:
    """A context as parallel blocks, with the question-pass tokens and what the capture reads from them."""

    prefix: tuple[int, ...]
    blocks: list[Block]
    question_ids: list[int]
    q_rows: list[int]  # rows of the question's own tokens in ``question_ids``
    n_units: int
    n_docs: int
    max_positions: int | None = None  # the model's positions (None: unbounded)

    @property
    def longest(self) -> int:
        return max((len(b.ids) for b in self.blocks), default=0)

    @property
    def question_start(self) -> int:
        """Position id of the first question-pass token: right after the longest block, moved back (overlapping
        the longest blocks' last positions) where a very long question would otherwise pass the model's
        positions."""
        start = len(self.prefix) + self.longest
        if self.max_positions is not None:
            start = min(start, max(self.max_positions - len(self.question_ids), len(self.prefix)))
        return start


def _cut(tokenizer: object, text: str, *, specials: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and offsets of ``text`` as it stands before :data:`FOLLOWER` (cut at the end of ``text``)."""
    enc = tokenizer(text + FOLLOWER, return_offsets_mapping=True, add_special_tokens=specials)  # type: ignore[operator]
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    end = len(text)
    for tok, (s, e) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        s, e = int(s), int(e)
        if s >= end and e > s:
            break
        if e > end:  # a token crosses into the follower: tokenize the text alone instead
            return _alone(tokenizer, text, specials=specials)
        ids.append(int(tok))
        offsets.append((s, e))
    return ids, offsets


def _alone(tokenizer: object, text: str, *, specials: bool) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=specials)  # type: ignore[operator]
    return [int(t) for t in enc["input_ids"]], [(int(s), int(e)) for s, e in enc["offset_mapping"]]


def block_tokens(tokenizer: object, units: Sequence[str], first_unit: int) -> tuple[list[int], list[int]]:
    """Token ids of one block (``units`` verbatim, then the separator) and each token's unit (-1: none)."""
    text = "".join(units) + DOC_SEPARATOR
    ids, offsets = _cut(tokenizer, text, specials=False)
    starts = np.cumsum([0] + [len(u) for u in units])
    unit_of = []
    for s, e in offsets:
        last = e - 1
        j = int(np.searchsorted(starts, last, side="right")) - 1
        unit_of.append(first_unit + j if e > s and 0 <= j < len(units) else -1)
    return ids, unit_of


def question_tokens(tokenizer: object, question: str) -> tuple[list[int], list[int]]:
    """Question-pass token ids (``Question: <q>`` and ``Answer:``) and the rows of the question's own tokens."""
    text = QUESTION_PREFIX + question + ANSWER_SUFFIX
    ids, offsets = _alone(tokenizer, text, specials=False)
    qs, qe = len(QUESTION_PREFIX), len(QUESTION_PREFIX) + len(question)
    rows = [i for i, (s, e) in enumerate(offsets) if e > s and qs <= e - 1 and s < qe]
    return ids, rows


def prefix_tokens(tokenizer: object) -> list[int]:
    """The shared prefix ``Documents:\\n`` (with the tokenizer's special tokens, as the joint prompt begins)."""
    ids, _ = _cut(tokenizer, CONTEXT_PREFIX, specials=True)
    return ids


def parallel_prompt(
    tokenizer: object,
    docs: Sequence[Sequence[str]],
    question: str,
    *,
    max_block_tokens: int,
    max_positions: int | None = None,
) -> ParallelPrompt:
    """Blocks for ``docs`` (each a sequence of unit strings) and the question-pass tokens for ``question``.

    A document whose block would exceed ``max_block_tokens`` is split into blocks of whole units.
    """
    if not question.strip():
        raise InvalidInputError("question is empty")
    if not any(len(u) for u in docs):
        raise InvalidInputError(
            "no context to score: " + ("no documents were given" if not docs else "every document is empty")
        )
    q_ids, q_rows = question_tokens(tokenizer, question)
    blocks: list[Block] = []
    first = 0
    total = len(q_ids)
    for d, units in enumerate(docs):
        if units:
            mine = _doc_blocks(tokenizer, d, list(units), first, max_block_tokens)
            blocks.extend(mine)
            total += sum(len(b.ids) for b in mine)
            check_proxy_tokens(total)  # the limit in force (rag_opt.work), document by document: before any model work
        first += len(units)
    return ParallelPrompt(tuple(prefix_tokens(tokenizer)), blocks, q_ids, q_rows, first, len(docs), max_positions)


BLOCK_MEMO = 4096  # documents whose blocks are remembered (tokenizing them is a tenth of a warm request)


def _doc_blocks(tokenizer: object, d: int, units: list[str], first: int, limit: int) -> list[Block]:
    """The blocks of document ``d`` (its units numbered from ``first``); a document seen recently is not tokenized
    again (:func:`_local_blocks`)."""
    return [
        Block(d, ids, tuple(u + first if u >= 0 else -1 for u in unit_of))
        for ids, unit_of in _local_blocks(tokenizer, tuple(units), limit)
    ]


@lru_cache(maxsize=BLOCK_MEMO)
def _local_blocks(
    tokenizer: object, units: tuple[str, ...], limit: int
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """(ids, unit of each token, numbered from 0) of each block of one document (thread-safe, bounded)."""
    return tuple((b.ids, b.unit_of) for b in _tokenize_blocks(tokenizer, 0, list(units), 0, limit))


def _tokenize_blocks(tokenizer: object, d: int, units: list[str], first: int, limit: int) -> list[Block]:
    ids, unit_of = block_tokens(tokenizer, units, first)
    if len(ids) <= limit:
        return [Block(d, tuple(ids), tuple(unit_of))]
    # too long: pieces of whole units, each a block of its own (the separator stays with the last piece). Linear in
    # the document: the pieces are planned on the whole document's tokens (each unit's count), then each piece is
    # tokenized once; a piece whose own tokens come out over the limit (a merge across a unit's edge) gives back
    # its last unit. Cancellation (rag_opt.work) is checked between pieces.
    counts = np.bincount(np.asarray([u - first for u in unit_of if u >= 0], dtype=np.int64), minlength=len(units))
    out: list[Block] = []
    a = 0
    while a < len(units):
        checkpoint()
        b, total = a + 1, int(counts[a])
        while b < len(units) and total + int(counts[b]) <= limit:
            total += int(counts[b])
            b += 1
        piece_ids, piece_units = _piece(tokenizer, units, first, a, b)
        while len(piece_ids) > limit and b - a > 1:
            b -= 1
            piece_ids, piece_units = _piece(tokenizer, units, first, a, b)
        if len(piece_ids) > limit:
            logger.warning(
                "a unit of %d proxy tokens exceeds the block limit of %d: only its first %d tokens are read",
                len(piece_ids),
                limit,
                limit,
            )
            piece_ids, piece_units = piece_ids[:limit], piece_units[:limit]
        out.append(Block(d, tuple(piece_ids), tuple(piece_units)))
        a = b
    return out


def _piece(tokenizer: object, units: list[str], first: int, a: int, b: int) -> tuple[list[int], list[int]]:
    if b == len(units):
        return block_tokens(tokenizer, units[a:b], first + a)
    text = "".join(units[a:b])
    ids, offsets = _cut(tokenizer, text, specials=False)
    starts = np.cumsum([0] + [len(u) for u in units[a:b]])
    unit_of = []
    for s, e in offsets:
        j = int(np.searchsorted(starts, e - 1, side="right")) - 1
        unit_of.append(first + a + j if e > s and 0 <= j < b - a else -1)
    return ids, unit_of


def context_positions(prompt: ParallelPrompt) -> tuple[list[int], list[int]]:
    """Positions in the concatenated cache (prefix, then the blocks in order) of every token that belongs to a
    unit, and that unit."""
    ctx_pos: list[int] = []
    unit_of: list[int] = []
    pos = len(prompt.prefix)
    for block in prompt.blocks:
        for i, u in enumerate(block.unit_of):
            if u >= 0:
                ctx_pos.append(pos + i)
                unit_of.append(u)
        pos += len(block.ids)
    return ctx_pos, unit_of
