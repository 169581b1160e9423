"""Compact encoding-cache entries: the cached keys and values quantized, and their serialized form.

A parallel encoding's cache entry is one block's key/value states, ``(2, layers, kv_heads, tokens, head_dim)``
(keys then values), or a block's *source queries*, ``(layers, heads, sources, head_dim)`` (the cross-document
reading's). Kept in the model's dtype (bf16) the embedded SmolLM2-135M's take 12,288 bytes per token at 16 layers.
A *format* stores them smaller (after KIVI, ICML 2024, and CacheGen, arXiv 2310.07240):

* **keys per channel**: each layer's, head's and channel's keys over the block's tokens (``k4g32v2``, ``k4g64v2``:
  over each group of 32 or 64 tokens) share one scale and zero point (a few channels carry large magnitudes over
  every token: a per-token scale would spend its levels on them);
* **values per token**: each token's, layer's and head's value vector shares one scale and zero point;
* **source queries per row**: each query vector its own symmetric scale.

===========  ====  ======  ===============  ==========================================================
format       keys  values  source queries   bytes per document token, everything included (the embedded
                                            model at 16 layers, 600 HotpotQA dev questions: docs/operations.md)
===========  ====  ======  ===============  ==========================================================
``bf16``     bf16  bf16    bf16             12,945: the model's dtype, unchanged (not quantized)
``int8``     8     8       8                6,569
``k8v4``     8     4       8                5,129
``k8v2``     8     2       8                4,409: within 0.005 of bf16 in facts and answers kept (the default
                                            until 2026-12-06)
``k4v4``     4     4       8                3,593
``k4v2``     4     2       8                about 2,870
``k4g64v2``  4     2       8                about 3,015 (keys' scales per 64 tokens)
``k4g32v2``  4     2       8                3,213 (keys' scales per 32 tokens, KIVI's grouping): within 0.005 of bf16
                                            on 600 questions, not on the next 300 (docs/operations.md)
``k4hv2``    4     2       8                2,969 (keys rotated, then one scale per token: QuaRot's)
``k4hw3v2``  4/8   2       8                3,243 (as ``k4hv2``, but layers 7, 14 and 15 keep 8-bit keys)
``k4w6v2q4`` 4/8   2       4                3,286 (as ``k4v2``, but layers 5, 7, 8, 9, 14 and 15 keep 8-bit keys)
``k5vh2``    5     2       8                3,257 (values rotated before their 2-bit codes): within 0.005 of bf16 on
                                            600 questions and on 1,466, not on the first 900 (docs/operations.md)
``k5vh2q6``  5     2       6                3,173 (as ``k5vh2``, 6-bit source queries): the smallest within 0.005
                                            of bf16 over all 1,466 dev questions it was run on (the first 600 alone:
                                            none 1/5 facts -0.0057; docs/operations.md); the default,
                                            :data:`DEFAULT_FORMAT`
===========  ====  ======  ===============  ==========================================================

The names read: ``k`` and the keys' bits, ``g`` and the tokens that share a key scale, ``h`` rotated keys, ``w``
and the layers whose keys stay at 8 bits (the layers whose keys move the sentence scores most,
``benchmarks/ablations/key_bits_by_layer.py``: those of the embedded model), ``v`` and the values' bits (``vh``:
values rotated before their codes), ``q`` and the source queries' bits when not 8.

Scales and zero points are float16. Quantized codes are packed (two 4-bit or four 2-bit codes a byte, along the
head dimension); the primitives are :mod:`rag_opt.models.kv_quant`. A format is part of the cache's store key:
entries of two formats never mix.

An :class:`EncodedStates` is what the cache holds and hands out. It decodes lazily: the question pass copies a
block's states into its buffer once per document set (:mod:`rag_opt.models.question_buffer`), decoding them straight
into that buffer (:meth:`EncodedStates.decode_into`); another question over the same documents reads the buffer and
decodes nothing. Serialized (:meth:`EncodedStates.to_bytes`) an entry is a safetensors blob (plain tensors, never
pickle) that records its format, key, shape and a SHA-256 of its tensors; :func:`from_bytes` refuses a blob that
does not match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_opt.errors import InvalidInputError
from rag_opt.models.kv_quant import (
    dequant,
    dequant_grouped,
    dequant_rows,
    dequant_values,
    dequantized,
    hadamard,
    quant,
    quant_grouped,
    quant_symmetric,
    rounded_into,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "BLOB_FORMAT",
    "DEFAULT_FORMAT",
    "FORMATS",
    "EncodedStates",
    "KVFormat",
    "encode_states",
    "from_bytes",
    "resolve_format",
]

BLOB_FORMAT = "rag-opt-encoding/2"


@dataclass(frozen=True)
class KVFormat:
    """How an entry is stored: bits of keys, values and source queries (16: the model's dtype, unchanged)."""

    name: str
    key_bits: int
    value_bits: int
    query_bits: int
    #: tokens that share one key scale and zero point per channel (0: the block's every token)
    key_group: int = 0
    #: keys rotated by an orthonormal Hadamard matrix over the head dimension before they are quantized, and
    #: rotated back when decoded (QuaRot, arXiv 2404.00456): the few channels that carry large magnitudes are spread
    #: over all, so every code level serves the whole head; each token's rotated key gets one scale and zero point
    key_rotated: bool = False
    #: layers whose keys are kept at 8 bits per channel whatever ``key_bits`` (the layers whose keys move the
    #: sentence scores most, ``benchmarks/ablations/key_bits_by_layer.py``); the others' keys take ``key_bits``
    wide_key_layers: tuple[int, ...] = ()
    #: values rotated by the same Hadamard matrix before they are quantized (per token), rotated back when decoded
    value_rotated: bool = False

    @property
    def quantized(self) -> bool:
        return min(self.key_bits, self.value_bits, self.query_bits) < 16


FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("bf16", 16, 16, 16),
        KVFormat("int8", 8, 8, 8),
        KVFormat("k8v4", 8, 4, 8),
        KVFormat("k8v2", 8, 2, 8),
        KVFormat("k4v4", 4, 4, 8),
        KVFormat("k4v2", 4, 2, 8),
        KVFormat("k4g64v2", 4, 2, 8, key_group=64),
        KVFormat("k4g32v2", 4, 2, 8, key_group=32),
        KVFormat("k4hv2", 4, 2, 8, key_rotated=True),
        KVFormat("k4w6v2q4", 4, 2, 4, wide_key_layers=(5, 7, 8, 9, 14, 15)),
        KVFormat("k4hw3v2", 4, 2, 8, key_rotated=True, wide_key_layers=(7, 14, 15)),
        KVFormat("k5vh2", 5, 2, 8, value_rotated=True),
        KVFormat("k5vh2q6", 5, 2, 6, value_rotated=True),
    )
}
DEFAULT_FORMAT = "k5vh2q6"


def resolve_format(spec: str | KVFormat | None) -> KVFormat:
    """A :class:`KVFormat` from its name (None: :data:`DEFAULT_FORMAT`); an unknown name raises
    :class:`~rag_opt.errors.InvalidInputError` listing the known ones."""
    if spec is None:
        return FORMATS[DEFAULT_FORMAT]
    if isinstance(spec, KVFormat):
        return spec
    if isinstance(spec, str) and spec in FORMATS:
        return FORMATS[spec]
    raise InvalidInputError(f"unknown cache format {spec!r}: use one of {', '.join(FORMATS)}")


class EncodedStates:
    """One cache entry as stored: its tensors (codes, scales, zero points, or the states unchanged), the shape and
    dtype it decodes to, and its format. Immutable once made; safe to share between threads."""

    __slots__ = ("format", "kind", "shape", "dtype", "tensors", "nbytes")

    def __init__(
        self, fmt: KVFormat, kind: str, shape: tuple[int, ...], dtype: torch.dtype, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        self.format = fmt
        self.kind = kind  # "kv": (2, L, KVH, T, d) keys and values; "rows": (L, H, S, d) source queries
        self.shape = shape
        self.dtype = dtype
        self.tensors = dict(tensors)
        self.nbytes = sum(int(t.numel() * t.element_size()) for t in self.tensors.values())

    @property
    def tokens(self) -> int:
        """Tokens (kv) or rows (source queries) the entry holds."""
        return int(self.shape[3] if self.kind == "kv" else self.shape[2])

    def decode(self, dtype: torch.dtype | None = None, depth: int | None = None) -> torch.Tensor:
        """The states, ``shape`` (its first ``depth`` layers), in ``dtype`` (default: the model's)."""
        import torch

        dtype = dtype or self.dtype
        if self.kind == "rows":
            raw = self.tensors.get("states")
            if raw is not None:
                return (raw if depth is None else raw[:depth]).to(dtype)
            return dequant_rows(self.tensors, self.format.query_bits, self.shape, depth).to(dtype)
        layers = self.shape[1] if depth is None else min(depth, self.shape[1])
        out = torch.empty((2, layers, *self.shape[2:]), dtype=dtype)
        self.decode_into(out, layers)
        return out

    def decode_keys(self, depth: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The keys of the first ``depth`` layers, ``(depth, KVH, T, d)``, in ``dtype`` (default: the model's)."""
        import torch

        if self.kind != "kv":
            raise ValueError("only key/value entries have keys")
        raw = self.tensors.get("states")
        if raw is not None:
            return raw[0, :depth].to(dtype or self.dtype)
        layers = min(depth, self.shape[1])
        out = torch.empty((layers, *self.shape[2:]), dtype=dtype or self.dtype)
        _dequant_keys(self.tensors, self.format, self.shape, layers, out, self.dtype)
        return out

    def decode_into(self, out: torch.Tensor, depth: int) -> None:
        """Write the first ``depth`` layers' keys and values into ``out`` (``(2, depth, KVH, T, d)``, any float
        dtype and strides): a question buffer's slice, decoded in place."""
        if self.kind != "kv":
            raise ValueError("only key/value entries decode into a question buffer")
        raw = self.tensors.get("states")
        if raw is not None:
            out.copy_(raw[:, :depth])
            return
        f = self.format
        _dequant_keys(self.tensors, f, self.shape, depth, out[0], self.dtype)
        stored = min(depth, self.shape[1] - 1)  # the last layer's values are not stored (see encode_states)
        if f.value_rotated:
            values = dequantized(self.tensors, "v", f.value_bits, self.shape[4], stored) @ hadamard(self.shape[4])
            rounded_into(out[1, :stored], values, self.dtype)
        else:
            dequant_values(self.tensors, f.value_bits, self.shape, stored, out[1, :stored], self.dtype)
        out[1, stored:depth].zero_()

    # -- serialization -----------------------------------------------------------------------------------------
    def to_bytes(self, key: str) -> bytes:
        """The entry as a safetensors blob that records ``key``, the format, shape, dtype and a checksum."""
        from safetensors.torch import save

        tensors = {name: t.contiguous() for name, t in sorted(self.tensors.items())}
        meta = {
            "format": BLOB_FORMAT,
            "kv_format": self.format.name,
            "kind": self.kind,
            "key": key,
            "shape": "x".join(str(n) for n in self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "sha256": _digest(tensors),
        }
        return bytes(save(tensors, metadata=meta))


def from_bytes(blob: bytes, key: str) -> EncodedStates:
    """The entry serialized in ``blob`` (:meth:`EncodedStates.to_bytes`); raises ``ValueError`` when the blob is
    not one, is for another key or format version, or its checksum does not match."""
    import json
    import struct

    import torch
    from safetensors.torch import load

    if len(blob) < 8:
        raise ValueError("the entry is truncated")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise ValueError("the entry is truncated")
    try:
        meta = json.loads(blob[8 : 8 + n]).get("__metadata__") or {}
    except (ValueError, AttributeError):
        raise ValueError("the entry's header is not JSON") from None
    if meta.get("format") != BLOB_FORMAT or meta.get("key") != key:
        raise ValueError("the entry is for another key or format")
    try:
        tensors = load(blob)
    except Exception as exc:  # safetensors' own error type is no ValueError
        raise ValueError(f"the entry is not a readable safetensors blob ({exc})") from None
    if meta.get("sha256") != _digest(dict(sorted(tensors.items()))):
        raise ValueError("its checksum does not match")
    fmt = resolve_format(meta.get("kv_format"))
    kind = meta.get("kind")
    if kind not in ("kv", "rows"):
        raise ValueError(f"unknown entry kind {kind!r}")
    shape = tuple(int(x) for x in str(meta.get("shape", "")).split("x") if x)
    dtype = getattr(torch, str(meta.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError("unknown dtype")
    entry = EncodedStates(fmt, kind, shape, dtype, tensors)
    if "states" in tensors and tuple(tensors["states"].shape) != shape:
        raise ValueError("its shape does not match the recorded one")
    return entry


def encode_states(states: torch.Tensor, fmt: KVFormat | str | None = None) -> EncodedStates:
    """``states`` stored in ``fmt``: a 5-D ``(2, L, KVH, T, d)`` key/value tensor or a 4-D ``(L, H, S, d)`` source
    query tensor."""

    f = resolve_format(fmt)
    shape = tuple(int(n) for n in states.shape)
    if states.dim() == 5 and shape[0] == 2:
        kind = "kv"
    elif states.dim() == 4:
        kind = "rows"
    else:
        raise ValueError(f"cannot store states of shape {shape}: expected (2, L, KVH, T, d) or (L, H, S, d)")
    dtype = states.dtype
    if kind == "kv":
        if f.key_bits == 16 and f.value_bits == 16:
            return EncodedStates(f, kind, shape, dtype, {"states": states.contiguous()})
        x = states.float()
        tensors: dict[str, torch.Tensor] = {}
        narrow, wide = _key_layers(f, shape[1], shape[1])
        keys = x[0, narrow] if wide else x[0]
        if f.key_rotated:  # keys: rotated, then per token over the rotated channels
            quant(keys @ hadamard(shape[4]), f.key_bits, dim=3, prefix="k", out=tensors)
        elif f.key_group:  # keys: per channel, over each group of tokens
            quant_grouped(keys, f.key_bits, f.key_group, prefix="k", out=tensors)
        else:  # keys: per channel, over the block's tokens
            quant(keys, f.key_bits, dim=2, prefix="k", out=tensors)
        if wide:  # the wide layers' keys: 8 bits per channel, over the block's tokens
            quant(x[0, wide], 8, dim=2, prefix="kw", out=tensors)
        # values: per token, over the channels; the last layer's are not stored: a question pass reads an entry's
        # last layer for its attention rows only (keys), and its output there is never used
        values = x[1, :-1] @ hadamard(shape[4]) if f.value_rotated else x[1, :-1]
        quant(values, f.value_bits, dim=3, prefix="v", out=tensors)
        return EncodedStates(f, kind, shape, dtype, tensors)
    if f.query_bits == 16:
        return EncodedStates(f, kind, shape, dtype, {"states": states.contiguous()})
    tensors = {}
    quant_symmetric(states.float(), f.query_bits, out=tensors)
    return EncodedStates(f, kind, shape, dtype, tensors)


def _key_layers(fmt: KVFormat, layers: int, depth: int) -> tuple[list[int], list[int]]:
    """The first ``depth`` of an entry's ``layers`` layers split into those whose keys take ``key_bits`` and the
    format's wide ones (8 bits), each in order (stored in that order, so the first ``depth`` are a prefix of each)."""
    wide = [i for i in range(min(depth, layers)) if i in fmt.wide_key_layers]
    narrow = [i for i in range(min(depth, layers)) if i not in fmt.wide_key_layers]
    return narrow, wide


def _dequant_keys(
    tensors: Mapping[str, torch.Tensor],
    fmt: KVFormat,
    shape: tuple[int, ...],
    depth: int,
    out: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    narrow, wide = _key_layers(fmt, shape[1], depth)
    if wide:
        import torch

        part = torch.empty((len(narrow), *out.shape[1:]), dtype=torch.float32)
        _dequant_narrow_keys(tensors, fmt, shape, len(narrow), part, dtype)
        for j, layer in enumerate(narrow):
            out[layer].copy_(part[j])
        rounded = dequantized(tensors, "kw", 8, shape[4], len(wide)).to(dtype)
        for j, layer in enumerate(wide):
            out[layer].copy_(rounded[j])
        return
    _dequant_narrow_keys(tensors, fmt, shape, depth, out, dtype)


def _dequant_narrow_keys(
    tensors: Mapping[str, torch.Tensor],
    fmt: KVFormat,
    shape: tuple[int, ...],
    depth: int,
    out: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    if fmt.key_rotated:
        rounded_into(out, dequantized(tensors, "k", fmt.key_bits, shape[4], depth) @ hadamard(shape[4]), dtype)
    elif fmt.key_group and fmt.key_bits != 16:
        dequant_grouped(tensors, "k", fmt.key_bits, shape[4], fmt.key_group, depth, out, dtype)
    else:
        dequant(tensors, "k", fmt.key_bits, shape[4], depth, out, dtype)


def _digest(tensors: Mapping[str, torch.Tensor]) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode() + b"\0")
        data = t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t.contiguous()
        h.update(data.reshape(-1).numpy().tobytes())
    return h.hexdigest()
