"""Decoded copies of the recently read quantized entries of an encoding cache.

Decoding a compact entry is work per document, not per question: a ``k5vh2q6`` block (5-bit keys from two bit
planes, values rotated back) takes several times as long to decode as a bf16 one takes to copy. An
:class:`~rag_opt.models.encoding_cache.EncodingCache` therefore keeps the decoded states of the quantized entries
its question passes read last (:class:`DecodedEntries`, ``decoded_bytes`` of them, least recently read evicted):
a document read again, with any question and among any other documents, is copied from its decoded states instead
of decoded again. They are kept in the model's dtype, which decoding rounds to
(:func:`rag_opt.models.kv_quant.rounded_into`), so a buffer assembled from them holds exactly what decoding gives.

An entry is kept by the identity of the :class:`~rag_opt.models.kv_codec.EncodedStates` it was decoded from (held
with it, so the identity stays its own) and the depth read. The cache's memory tier hands out the same object for
every hit, so a document kept there is found here too; one the memory tier has evicted keeps its decoded states
(and its encoded entry, ~1/4 of their size at ``k5vh2q6``) until evicted here. bf16 entries are copied as they are,
never kept twice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from rag_opt.errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.kv_codec import EncodedStates

__all__ = ["DEFAULT_DECODED_BYTES", "DecodedEntries"]

# ~13 sets of 10 HotpotQA paragraphs at 16 layers in bf16 (12,288 bytes a token): warm requests over them cost what
# bf16 entries cost (benchmarks/warm_path.py: 0.98x)
DEFAULT_DECODED_BYTES = 256 << 20


class DecodedEntries:
    """An LRU of decoded quantized entries bounded in bytes (``max_bytes``; 0 keeps none). Thread-safe: one lock
    guards the index and the counters; copies run outside it."""

    def __init__(self, max_bytes: int = DEFAULT_DECODED_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidInputError(f"decoded entries' max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, int], tuple[EncodedStates, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def bytes(self) -> int:
        """Bytes of the decoded states held."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def parts(self) -> list[EncodedStates]:
        """The entries whose decoded states are held, least recently read first."""
        with self._lock:
            return [part for part, _ in self._entries.values()]

    def decode_into(self, part: EncodedStates, out: torch.Tensor, depth: int) -> None:
        """``part``'s first ``depth`` layers written into ``out``: copied from its decoded states when they are held,
        else decoded, and a quantized entry's decoded states then kept (an entry larger than the bound is not)."""
        if not part.format.quantized or self.max_bytes == 0:
            part.decode_into(out, depth)
            return
        key = (id(part), depth)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if hit is not None:
            out.copy_(hit[1])
            return
        part.decode_into(out, depth)
        size = out.numel() * part.dtype.itemsize
        if size > self.max_bytes:  # too large to keep: not copied at all
            return
        kept = out.to(part.dtype, copy=True)
        with self._lock:
            if key in self._entries:  # read by another pass meanwhile
                return
            self._entries[key] = (part, kept)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()

    def clear(self) -> None:
        """Drop every decoded entry (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
