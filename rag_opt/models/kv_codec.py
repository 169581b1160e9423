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
``k8v2``     8     2       8                4,409: the smallest within 0.005 of bf16 in facts and answers kept
                                            (the default, :data:`DEFAULT_FORMAT`)
``k4v4``     4     4       8                3,593
``k4v2``     4     2       8                about 2,870
``k4g64v2``  4     2       8                about 3,015 (keys' scales per 64 tokens)
``k4g32v2``  4     2       8                3,211 (keys' scales per 32 tokens, KIVI's grouping)
``k4hv2``    4     2       8                2,969 (keys rotated, then one scale per token: QuaRot's)
===========  ====  ======  ===============  ==========================================================

Scales and zero points are float16. Quantized codes are packed (two 4-bit or four 2-bit codes a byte, along the
head dimension). A format is part of the cache's store key: entries of two formats never mix.

An :class:`EncodedStates` is what the cache holds and hands out. It decodes lazily: the question pass copies a
block's states into its buffer once per document set (:mod:`rag_opt.models.question_buffer`), decoding them straight
into that buffer (:meth:`EncodedStates.decode_into`); another question over the same documents reads the buffer and
decodes nothing. Serialized (:meth:`EncodedStates.to_bytes`) an entry is a safetensors blob (plain tensors, never
pickle) that records its format, key, shape and a SHA-256 of its tensors; :func:`from_bytes` refuses a blob that
does not match.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_opt.errors import InvalidInputError

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
    )
}
DEFAULT_FORMAT = "k8v2"


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
            return _dequant_rows(self.tensors, self.format.query_bits, self.shape, depth).to(dtype)
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
        _dequant_values(self.tensors, f.value_bits, self.shape, stored, out[1, :stored], self.dtype)
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
        if f.key_rotated:  # keys: rotated, then per token over the rotated channels
            _quant(x[0] @ _hadamard(shape[4]), f.key_bits, dim=3, prefix="k", out=tensors)
        elif f.key_group:  # keys: per channel, over each group of tokens
            _quant_grouped(x[0], f.key_bits, f.key_group, prefix="k", out=tensors)
        else:  # keys: per channel, over the block's tokens
            _quant(x[0], f.key_bits, dim=2, prefix="k", out=tensors)
        # values: per token, over the channels; the last layer's are not stored: a question pass reads an entry's
        # last layer for its attention rows only (keys), and its output there is never used
        _quant(x[1, :-1], f.value_bits, dim=3, prefix="v", out=tensors)
        return EncodedStates(f, kind, shape, dtype, tensors)
    if f.query_bits == 16:
        return EncodedStates(f, kind, shape, dtype, {"states": states.contiguous()})
    tensors = {}
    _quant_symmetric(states.float(), f.query_bits, out=tensors)
    return EncodedStates(f, kind, shape, dtype, tensors)


# -- quantization ------------------------------------------------------------------------------------------------
def _quant(x: torch.Tensor, bits: int, *, dim: int, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Asymmetric ``bits``-bit codes of ``x`` (L, H, T, d) with one float16 scale and minimum per slice along
    ``dim`` (2: per channel over tokens; 3: per token over channels); 16 bits keeps ``x`` in bfloat16."""
    import torch

    if bits == 16:
        out[prefix] = x.to(torch.bfloat16)
        return
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).to(torch.float16)
    lo16 = lo.to(torch.float16)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((x - lo16.float()) / s).clamp_(0, levels).to(torch.uint8)
    out[prefix] = _pack(codes, bits)
    out[prefix + "_scale"] = scale
    out[prefix + "_min"] = lo16


def _dequant(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    bits: int,
    d: int,
    depth: int,
    out: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    if bits == 16:
        out.copy_(tensors[prefix][:depth])
        return
    _rounded_into(out, _dequantized(tensors, prefix, bits, d, depth), dtype)


def _dequantized(tensors: Mapping[str, torch.Tensor], prefix: str, bits: int, d: int, depth: int) -> torch.Tensor:
    """:func:`_quant`'s codes of the first ``depth`` layers decoded, in float32."""
    scale = tensors[prefix + "_scale"][:depth].float()  # small: converted once, not per element
    lo = tensors[prefix + "_min"][:depth].float()
    return _unpack(tensors[prefix][:depth], bits, d).float().mul_(scale).add_(lo)


@functools.lru_cache(maxsize=8)
def _hadamard(d: int) -> torch.Tensor:
    """An orthonormal, symmetric ``d`` × ``d`` rotation (its own inverse): Sylvester's Hadamard matrix of the largest
    power of two dividing ``d``, normalized, repeated along the diagonal."""
    import torch

    b = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(b)
    return torch.block_diag(*([h] * (d // b)))


def _rounded_into(out: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
    """``values`` (float32) rounded to ``dtype`` (the model's) and written into ``out`` (any float dtype): a float32
    question buffer reads exactly what a buffer in the model's dtype does, so one question alone and the same question
    in a batch read the same states."""
    out.copy_(values if dtype == values.dtype else values.to(dtype))


def _quant_grouped(x: torch.Tensor, bits: int, group: int, *, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Asymmetric ``bits``-bit codes of ``x`` (L, H, T, d), one float16 scale and minimum per channel and per group
    of ``group`` tokens (the last group may be shorter): KIVI's grouping, which follows keys that drift along the
    block (rotary positions) with the same bits."""
    import torch

    t = x.shape[2]
    groups = -(-t // group)
    pad = groups * group - t
    xp = torch.cat([x, x[:, :, -1:].expand(-1, -1, pad, -1)], dim=2) if pad else x
    xg = xp.unflatten(2, (groups, group))  # (L, H, G, group, d)
    lo = xg.amin(dim=3, keepdim=True)
    hi = xg.amax(dim=3, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).to(torch.float16)
    lo16 = lo.to(torch.float16)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((xg - lo16.float()) / s).clamp_(0, levels).to(torch.uint8).flatten(2, 3)[:, :, :t]
    out[prefix] = _pack(codes, bits)
    out[prefix + "_scale"] = scale.squeeze(3)  # (L, H, G, d)
    out[prefix + "_min"] = lo16.squeeze(3)


def _dequant_grouped(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    bits: int,
    d: int,
    group: int,
    depth: int,
    out: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Decode :func:`_quant_grouped`'s codes into ``out`` (depth, H, T, d) (any strides), rounded to ``dtype``."""
    x = _unpack(tensors[prefix][:depth], bits, d).float()
    scale = tensors[prefix + "_scale"][:depth].float()  # (depth, H, G, d)
    lo = tensors[prefix + "_min"][:depth].float()
    t = x.shape[2]
    full = t // group
    if full:
        body = x[:, :, : full * group].unflatten(2, (full, group))  # a view: writes reach ``x``
        body.mul_(scale[:, :, :full, None]).add_(lo[:, :, :full, None])
    if t > full * group:
        tail = x[:, :, full * group :]
        tail.mul_(scale[:, :, full, None]).add_(lo[:, :, full, None])
    _rounded_into(out, x, dtype)


def _dequant_keys(
    tensors: Mapping[str, torch.Tensor],
    fmt: KVFormat,
    shape: tuple[int, ...],
    depth: int,
    out: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    if fmt.key_rotated:
        _rounded_into(out, _dequantized(tensors, "k", fmt.key_bits, shape[4], depth) @ _hadamard(shape[4]), dtype)
    elif fmt.key_group and fmt.key_bits != 16:
        _dequant_grouped(tensors, "k", fmt.key_bits, shape[4], fmt.key_group, depth, out, dtype)
    else:
        _dequant(tensors, "k", fmt.key_bits, shape[4], depth, out, dtype)


def _dequant_values(
    tensors: Mapping[str, torch.Tensor],
    bits: int,
    shape: tuple[int, ...],
    depth: int,
    out: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    _dequant(tensors, "v", bits, shape[4], depth, out, dtype)


def _quant_symmetric(x: torch.Tensor, bits: int, *, out: dict[str, torch.Tensor]) -> None:
    """Symmetric ``bits``-bit codes of ``x`` (L, H, S, d), one float16 scale per row (per query vector)."""
    import torch

    half = (1 << (bits - 1)) - 1
    scale = (x.abs().amax(dim=-1, keepdim=True) / half).to(torch.float16)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round(x / s).clamp_(-half, half).add_(half).to(torch.uint8)
    out["q"] = _pack(codes, bits)
    out["q_scale"] = scale


def _dequant_rows(
    tensors: Mapping[str, torch.Tensor], bits: int, shape: tuple[int, ...], depth: int | None
) -> torch.Tensor:
    import torch

    half = (1 << (bits - 1)) - 1
    codes = tensors["q"] if depth is None else tensors["q"][:depth]
    scale = tensors["q_scale"] if depth is None else tensors["q_scale"][:depth]
    x = _unpack(codes, bits, shape[3]).to(torch.float32).sub_(half)
    return x.mul_(scale.float())


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8, each < 2**bits) packed along the last axis: 8 // bits codes a byte."""
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"the last dimension ({codes.shape[-1]}) must be a multiple of {per} to pack {bits}-bit codes")
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    packed = grouped[..., 0].clone()
    for i in range(1, per):
        packed |= grouped[..., i] << (bits * i)
    return packed.contiguous()


def _unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    import torch

    if bits == 8:
        return packed
    per = 8 // bits
    mask = (1 << bits) - 1
    out = torch.empty((*packed.shape, per), dtype=torch.uint8)
    torch.bitwise_and(packed, mask, out=out[..., 0])
    for i in range(1, per):
        if i == per - 1:  # the top codes need no mask
            torch.bitwise_right_shift(packed, bits * i, out=out[..., i])
        else:
            torch.bitwise_and(torch.bitwise_right_shift(packed, bits * i), mask, out=out[..., i])
    return out.view(*packed.shape[:-1], d)


def _digest(tensors: Mapping[str, torch.Tensor]) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode() + b"\0")
        data = t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t.contiguous()
        h.update(data.reshape(-1).numpy().tobytes())
    return h.hexdigest()
