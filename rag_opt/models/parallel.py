"""Parallel document encoding: every document read on its own, then one question pass over their caches.

The prompt is the joint one (``Documents:``, the documents separated by a blank line, ``Question: ...``,
``Answer:``), read differently:

* each document *block* (its text plus the separator after it) attends only to the shared prefix
  ``Documents:\\n`` and to itself, at positions that restart right after the prefix for every block. A block's
  key/value states therefore depend on nothing but its own tokens: they are computed once (a *document pass*,
  an ordinary causal forward of ``prefix + block``) and can be cached by content
  (:mod:`rag_opt.models.encoding_cache`);
* the question and ``Answer:`` tokens attend to the prefix, to every block and causally to themselves, at
  positions right after the longest block (the *question pass*, over the blocks' concatenated caches). The
  attention rows rag-opt reads come from this pass (:mod:`rag_opt.models.capture`).

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
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.errors import InvalidInputError
from rag_opt.models.capture import Capture, CaptureItem, StopForward, capturing
from rag_opt.models.prompt import ANSWER_SUFFIX, CONTEXT_PREFIX, DOC_SEPARATOR, QUESTION_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.loader import ProxyModel

__all__ = [
    "FOLLOWER",
    "Block",
    "ParallelPrompt",
    "QuestionPass",
    "block_tokens",
    "parallel_prompt",
    "question_mask",
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
        raise InvalidInputError("no context to score: every document is empty")
    blocks: list[Block] = []
    first = 0
    for d, units in enumerate(docs):
        if units:
            blocks.extend(_doc_blocks(tokenizer, d, list(units), first, max_block_tokens))
        first += len(units)
    q_ids, q_rows = question_tokens(tokenizer, question)
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
    # too long: pieces of whole units, each a block of its own (the separator stays with the last piece)
    out: list[Block] = []
    a = 0
    while a < len(units):
        b = a + 1
        piece_ids, piece_units = _piece(tokenizer, units, first, a, b)
        while b < len(units):
            nxt_ids, nxt_units = _piece(tokenizer, units, first, a, b + 1)
            if len(nxt_ids) > limit:
                break
            piece_ids, piece_units, b = nxt_ids, nxt_units, b + 1
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


@dataclass
class QuestionPass:
    """One batch row of a question pass: the cached keys/values it reads and what the capture reads."""

    prompt: ParallelPrompt
    parts: list[torch.Tensor]  # each (2, layers, KVH, n, d): keys then values of the prefix, then of each block

    @property
    def length(self) -> int:
        return sum(int(p.shape[3]) for p in self.parts)


def question_mask(lengths: Sequence[int], questions: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
    """The 4D additive mask of a batched question pass. Batch row ``b`` holds ``C_b`` cached tokens (padded to the
    longest) and, packed one after the other, the questions of ``questions[b]`` (their token counts): a
    question's token ``i`` sees the row's cached tokens and its own question's tokens up to ``i``, never another
    question's. Padding is masked; padded query rows see the first key only (their output is never read)."""
    import torch

    c_max = max(lengths)
    s_max = max(sum(q) for q in questions)
    neg = torch.finfo(dtype).min
    mask = torch.full((len(lengths), 1, s_max, c_max + s_max), neg, dtype=dtype)
    causal = torch.tril(torch.ones(s_max, s_max, dtype=torch.bool))
    for b, (c, qs) in enumerate(zip(lengths, questions, strict=True)):
        off = 0
        for q in qs:
            mask[b, 0, off : off + q, :c] = 0.0
            own = mask[b, 0, off : off + q, c_max + off : c_max + off + q]
            own[causal[:q, :q]] = 0.0
            off += q
        mask[b, 0, off:, 0] = 0.0
    return mask


def run_question_passes(proxy: ProxyModel, rows: Sequence[QuestionPass], depth: int) -> Capture:
    """One batched question pass over ``rows``' cached blocks, stopping after ``depth`` layers; returns the
    capture, whose items follow ``rows`` (attention rows of every row's question tokens and final token over its
    context tokens).

    Rows that read the same cached states (the same documents, e.g. several questions over one retrieved set) are
    packed into one batch row: their cached states are stored once, and each question attends to them and to
    itself only. The cached states reach the attention function through the capture (:attr:`Capture.past`),
    which writes the pass's own keys and values after them and computes each question's attention over exactly
    its keys (:func:`rag_opt.models.capture._question_attention`). The pass still gives the model its 4D mask
    with the explicit position ids: without one, restarting positions would trigger transformers' packed-sequence
    detection. The caller holds ``proxy.lock``."""
    import torch

    dev = proxy.device
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(id(p) for p in r.parts), []).append(i)
    members = list(groups.values())
    lengths = [rows[m[0]].length for m in members]
    questions = [[len(rows[i].prompt.question_ids) for i in m] for m in members]
    c_max, s_max = max(lengths), max(sum(q) for q in questions)
    buf = _assembled(proxy, [rows[m[0]].parts for m in members], depth, c_max, s_max)
    past = {layer: (buf[0, layer], buf[1, layer]) for layer in range(depth)}
    pad = proxy.tokenizer.pad_token_id
    pad = pad if pad is not None else proxy.tokenizer.eos_token_id or 0
    ids = torch.full((len(members), s_max), int(pad), dtype=torch.long)
    positions = torch.zeros((len(members), s_max), dtype=torch.long)
    items: list[CaptureItem | None] = [None] * len(rows)
    for b, m in enumerate(members):
        off = 0
        # the row's questions read the same blocks: one context, its tensors shared (the capture reads them once)
        ctx_pos, unit_of = context_positions(rows[m[0]].prompt)
        ctx = torch.tensor(ctx_pos, dtype=torch.long, device=dev)
        unit_of_ctx = torch.tensor(unit_of, dtype=torch.long, device=dev)
        for i in m:
            prompt = rows[i].prompt
            q = len(prompt.question_ids)
            ids[b, off : off + q] = torch.tensor(prompt.question_ids)
            positions[b, off : off + q] = prompt.question_start + torch.arange(q)
            items[i] = CaptureItem(
                ctx_pos=ctx,
                unit_of_ctx=unit_of_ctx,
                n_units=prompt.n_units,
                # rows of the pass's own queries: the question's tokens, then the final token
                q_rows=torch.tensor([off + j for j in prompt.q_rows] + [off + q - 1], dtype=torch.long, device=dev),
                n_question_rows=len(prompt.q_rows),
                row=b,
                rows=(off, off + q),
                cached=lengths[b],
            )
            off += q
    mask = question_mask(lengths, questions, proxy.dtype)
    capture = Capture(
        items=[it for it in items if it is not None],
        stop_after=depth - 1 if depth < proxy.num_layers else None,
        past=past,
        room_at=c_max,
    )
    base = getattr(proxy.model, "model", None) or proxy.model.base_model
    with capturing(capture), torch.inference_mode():
        if dev == "cpu":
            proxy.threads.apply()
        try:
            base(input_ids=ids.to(dev), position_ids=positions.to(dev), attention_mask=mask.to(dev), use_cache=False)
        except StopForward:
            pass
    if len(capture.sums) != depth:
        raise RuntimeError(
            f"captured attention from {len(capture.sums)} of {depth} layers: the proxy model's attention "
            "does not dispatch through transformers' AttentionInterface"
        )
    return capture


ASSEMBLED_KEEP = 1  # question-pass buffers kept per proxy model (each 2 x layers x KVH x tokens x d floats)
ASSEMBLED_MAX_BYTES = 128 << 20  # a larger one is not kept (10 HotpotQA paragraphs at 16 layers: ~38 MiB in fp32)
QUESTION_ROOM = 128  # room a kept buffer has for a question pass's own tokens (more: a new buffer)
ASSEMBLE_ONE_ROW_IN_FLOAT32 = True  # a one-row pass's buffer in float32 (False: the model's dtype; benchmarks)


@dataclass
class _Assembled:
    parts: tuple[torch.Tensor, ...]  # held: their ids in the key stay theirs
    depth: int
    buf: torch.Tensor


def _assembled(
    proxy: ProxyModel, row_parts: Sequence[Sequence[torch.Tensor]], depth: int, c_max: int, s_max: int
) -> torch.Tensor:
    """The buffer ``(2, layers, B, KVH, c_max + room, d)`` of a question pass: each batch row's cached parts copied
    once into place, with room after them for the pass's own keys and values (written there layer by layer:
    :attr:`Capture.room_at`), so every layer's keys and values are contiguous views and nothing is copied again
    (padding is zeroed and masked). A one-row buffer of at most :data:`ASSEMBLED_MAX_BYTES` in float32 is float32,
    the precision the question attention reads keys and values in (converted once here, not per layer); any other
    keeps the model's dtype.

    A pass of one batch row over the same parts as a recent one (another question over the same documents) reuses
    that pass's buffer: the parts are copied once, not per question. The last :data:`ASSEMBLED_KEEP` buffers of at
    most :data:`ASSEMBLED_MAX_BYTES` are kept per proxy model; the caller holds ``proxy.lock`` (a buffer is written
    by the pass that uses it)."""
    import torch

    first = row_parts[0][0]
    key: tuple[int, ...] | None = None
    one_row = len(row_parts) == 1
    room = max(s_max, QUESTION_ROOM) if one_row else s_max
    # one row's states are assembled in float32, the precision the question attention reads them in: converted
    # once while copied, not once per layer and question. Only while that buffer stays small enough to be kept: a
    # batch of rows, or a very long context, keeps the model's dtype (its memory)
    size32 = 2 * depth * first.shape[2] * (c_max + room) * first.shape[4] * 4
    small = one_row and size32 <= ASSEMBLED_MAX_BYTES
    dtype = torch.float32 if small and ASSEMBLE_ONE_ROW_IN_FLOAT32 else first.dtype
    if one_row:
        key = tuple(id(p) for p in row_parts[0])
        memo = proxy.question_buffers
        hit = memo.get(key)
        if hit is not None and hit.depth == depth and hit.buf.dtype == dtype and hit.buf.shape[4] >= c_max + s_max:
            memo.move_to_end(key)
            return hit.buf
    shape = (2, depth, len(row_parts), first.shape[2], c_max + room, first.shape[4])
    buf = _spare(proxy, shape, dtype) if key is not None else None
    if buf is None:
        buf = first.new_empty(shape, dtype=dtype)
    for b, parts in enumerate(row_parts):
        pos = 0
        for part in parts:
            n = int(part.shape[3])
            buf[:, :, b, :, pos : pos + n] = part[:, :depth]
            pos += n
        buf[:, :, b, :, pos:] = 0
    buf = buf.to(proxy.device)
    if key is not None and buf.numel() * buf.element_size() <= ASSEMBLED_MAX_BYTES:
        memo = proxy.question_buffers
        memo[key] = _Assembled(tuple(row_parts[0]), depth, buf)
        memo.move_to_end(key)
        while len(memo) > ASSEMBLED_KEEP:
            memo.popitem(last=False)
    return buf


def _spare(proxy: ProxyModel, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The storage of the kept buffer that a new one-row buffer would evict, reshaped to ``shape``, or None.

    A fresh buffer of tens of MiB costs its page faults on every pass over new documents (a third of a 10-document
    question pass's copy); the evicted one's memory is reused instead. Only on the CPU and while the caller holds
    ``proxy.lock``: nothing else reads an evicted buffer."""
    import math

    memo = proxy.question_buffers
    if proxy.device != "cpu" or len(memo) < ASSEMBLED_KEEP or not memo:
        return None
    old = next(iter(memo.values())).buf
    storage = old.untyped_storage()
    if old.dtype != dtype or storage.nbytes() < math.prod(shape) * old.element_size():
        return None
    memo.popitem(last=False)
    flat = old.new_empty(0).set_(storage, 0, (storage.nbytes() // old.element_size(),))  # all of it, not the view
    return flat[: math.prod(shape)].view(shape)


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
