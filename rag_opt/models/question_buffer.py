"""The buffer a question pass reads its cached keys and values from, and its reuse across passes.

A question pass (:mod:`rag_opt.models.question_pass`) reads each batch row's cached document states (the
prefix's, then every block's) as one contiguous tensor per layer, with room after them for the pass's own keys and
values. This module assembles that buffer, keeps the last one per proxy model (another question over the same
documents reuses it: nothing is copied again), and writes a pass over new documents into the memory of the buffer
it evicts (no fresh allocation's page faults).

A compact entry is written into place by the cache's decoded entries when the pass has them
(:class:`~rag_opt.models.decoded_entries.DecodedEntries`: a document read again is copied from its decoded states,
not decoded again), else decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.decoded_entries import DecodedEntries
    from rag_opt.models.kv_codec import EncodedStates
    from rag_opt.models.loader import ProxyModel

__all__ = [
    "ASSEMBLED_KEEP",
    "ASSEMBLED_MAX_BYTES",
    "ASSEMBLE_ONE_ROW_IN_FLOAT32",
    "BUFFER_ROOM",
    "AssembledBuffer",
    "assemble_states",
    "forget",
]

ASSEMBLED_KEEP = 1  # question-pass buffers kept per proxy model (each 2 x layers x KVH x tokens x d floats)
ASSEMBLED_MAX_BYTES = 128 << 20  # a larger one is not kept (10 HotpotQA paragraphs at 16 layers: ~38 MiB in fp32)
BUFFER_ROOM = 128  # room a kept buffer has for a question pass's own tokens (more: a new buffer)
ASSEMBLE_ONE_ROW_IN_FLOAT32 = True  # a one-row pass's buffer in float32 (False: the model's dtype; benchmarks)


@dataclass
class AssembledBuffer:
    """A kept question-pass buffer: the parts it was assembled from, its depth, and the buffer."""

    parts: tuple[EncodedStates, ...]  # held: their ids in the key stay theirs
    depth: int
    buf: torch.Tensor


def assemble_states(
    proxy: ProxyModel,
    row_parts: Sequence[Sequence[EncodedStates]],
    depth: int,
    c_max: int,
    s_max: int,
    decoded: DecodedEntries | None = None,
) -> torch.Tensor:
    """The buffer ``(2, layers, B, KVH, c_max + room, d)`` of a question pass: each batch row's cached parts copied
    once into place, with room after them for the pass's own keys and values (written there layer by layer:
    :attr:`rag_opt.models.capture.Capture.room_at`), so every layer's keys and values are contiguous views and
    nothing is copied again (padding is zeroed and masked). A one-row buffer of at most
    :data:`ASSEMBLED_MAX_BYTES` in float32 is float32, the precision the question attention reads keys and values
    in (converted once here, not per layer); any other keeps the model's dtype.

    ``decoded``: the cache's decoded entries, which write compact parts into place (None: each is decoded).

    A pass of one batch row over the same parts as a recent one (another question over the same documents) reuses
    that pass's buffer: the parts are copied once, not per question. The last :data:`ASSEMBLED_KEEP` buffers of at
    most :data:`ASSEMBLED_MAX_BYTES` are kept per proxy model; the caller holds ``proxy.lock`` (a buffer is written
    by the pass that uses it)."""
    import torch

    first = row_parts[0][0]
    key: tuple[int, ...] | None = None
    one_row = len(row_parts) == 1
    room = max(s_max, BUFFER_ROOM) if one_row else s_max
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
        buf = torch.empty(shape, dtype=dtype)
    _fill(buf, row_parts, depth, decoded)
    buf = buf.to(proxy.device)
    if key is not None and buf.numel() * buf.element_size() <= ASSEMBLED_MAX_BYTES:
        memo = proxy.question_buffers
        memo[key] = AssembledBuffer(tuple(row_parts[0]), depth, buf)
        memo.move_to_end(key)
        while len(memo) > ASSEMBLED_KEEP:
            memo.popitem(last=False)
    return buf


def _fill(
    buf: torch.Tensor, row_parts: Sequence[Sequence[EncodedStates]], depth: int, decoded: DecodedEntries | None
) -> None:
    """Each batch row's parts decoded straight into place in ``buf``, one after the other, the rest zeroed."""
    for b, parts in enumerate(row_parts):
        pos = 0
        for part in parts:
            into = buf[:, :, b, :, pos : pos + part.tokens]
            if decoded is not None:
                decoded.decode_into(part, into, depth)
            else:
                part.decode_into(into, depth)
            pos += part.tokens
        buf[:, :, b, :, pos:] = 0


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


def forget(proxy: ProxyModel) -> None:
    """Drop every kept buffer of ``proxy`` (benchmarks that time assembling; tests). The caller holds
    ``proxy.lock`` or runs nothing else on the model."""
    proxy.question_buffers.clear()
