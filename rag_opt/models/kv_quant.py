"""The quantization primitives of the encoding cache's compact entries (:mod:`rag_opt.models.kv_codec`): asymmetric
codes with float16 scales and minima per channel, per token or per group of tokens; symmetric codes per row; the
orthonormal Hadamard rotation of rotated keys; packing 4-bit and 2-bit codes into bytes. Every decoder computes in
float32 and rounds once to the model's dtype (:func:`rounded_into`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rag_opt.models import kv_rowwise

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "dequant",
    "dequant_grouped",
    "dequant_rows",
    "dequant_values",
    "dequantized",
    "hadamard",
    "pack",
    "quant",
    "quant_grouped",
    "quant_symmetric",
    "rounded_into",
    "unpack",
]


def quant(x: torch.Tensor, bits: int, *, dim: int, prefix: str, out: dict[str, torch.Tensor]) -> None:
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
    out[prefix] = pack(codes, bits)
    out[prefix + "_scale"] = scale
    out[prefix + "_min"] = lo16


def dequant(
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
    rounded_into(out, dequantized(tensors, prefix, bits, d, depth), dtype)


def dequantized(tensors: Mapping[str, torch.Tensor], prefix: str, bits: int, d: int, depth: int) -> torch.Tensor:
    """:func:`quant`'s codes of the first ``depth`` layers decoded, in float32 (codes with one scale per row, such as
    values, in one fused pass where FBGEMM can: :mod:`rag_opt.models.kv_rowwise`, the same numbers)."""
    codes, scale16, lo16 = tensors[prefix][:depth], tensors[prefix + "_scale"][:depth], tensors[prefix + "_min"][:depth]
    if scale16.shape[-1] == 1 and scale16.dim() == codes.dim():
        fused = kv_rowwise.rowwise_decode(codes, scale16, lo16, bits, d)
        if fused is not None:
            return fused
    scale = scale16.float()  # small: converted once, not per element
    lo = lo16.float()
    return unpack(codes, bits, d).float().mul_(scale).add_(lo)  # (a mixed uint8 x float32 product is slower)


@functools.lru_cache(maxsize=8)
def hadamard(d: int) -> torch.Tensor:
    """An orthonormal, symmetric ``d`` × ``d`` rotation (its own inverse): Sylvester's Hadamard matrix of the largest
    power of two dividing ``d``, normalized, repeated along the diagonal."""
    import torch

    b = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(b)
    return torch.block_diag(*([h] * (d // b)))


def rounded_into(out: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
    """``values`` (float32) rounded to ``dtype`` (the model's) and written into ``out`` (any float dtype): a float32
    question buffer reads exactly what a buffer in the model's dtype does, so one question alone and the same question
    in a batch read the same states."""
    out.copy_(values if dtype == values.dtype else values.to(dtype))


def quant_grouped(x: torch.Tensor, bits: int, group: int, *, prefix: str, out: dict[str, torch.Tensor]) -> None:
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
    out[prefix] = pack(codes, bits)
    out[prefix + "_scale"] = scale.squeeze(3)  # (L, H, G, d)
    out[prefix + "_min"] = lo16.squeeze(3)


def dequant_grouped(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    bits: int,
    d: int,
    group: int,
    depth: int,
    out: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Decode :func:`quant_grouped`'s codes into ``out`` (depth, H, T, d) (any strides), rounded to ``dtype``."""
    x = unpack(tensors[prefix][:depth], bits, d).float()
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
    rounded_into(out, x, dtype)


def dequant_values(
    tensors: Mapping[str, torch.Tensor],
    bits: int,
    shape: tuple[int, ...],
    depth: int,
    out: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    dequant(tensors, "v", bits, shape[4], depth, out, dtype)


def quant_symmetric(x: torch.Tensor, bits: int, *, out: dict[str, torch.Tensor]) -> None:
    """Symmetric ``bits``-bit codes of ``x`` (L, H, S, d), one float16 scale per row (per query vector)."""
    import torch

    half = (1 << (bits - 1)) - 1
    scale = (x.abs().amax(dim=-1, keepdim=True) / half).to(torch.float16)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round(x / s).clamp_(-half, half).add_(half).to(torch.uint8)
    out["q"] = pack(codes, bits)
    out["q_scale"] = scale


def dequant_rows(
    tensors: Mapping[str, torch.Tensor], bits: int, shape: tuple[int, ...], depth: int | None
) -> torch.Tensor:
    import torch

    half = (1 << (bits - 1)) - 1
    codes = tensors["q"] if depth is None else tensors["q"][:depth]
    scale = tensors["q_scale"] if depth is None else tensors["q_scale"][:depth]
    x = unpack(codes, bits, shape[3]).to(torch.float32).sub_(half)
    return x.mul_(scale.float())


#: bit widths stored as two planes (low bits, high bits), each packed as above, side by side along the last axis
_PLANES = {3: (2, 1), 5: (4, 1), 6: (4, 2)}


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8, each < 2**bits) packed along the last axis: 8 // bits codes a byte (1, 2, 4 or 8 bits);
    3, 5 and 6 bits as two planes of those side by side (5 bits: a 4-bit plane, then a 1-bit plane)."""
    if bits == 8:
        return codes.contiguous()
    if bits in _PLANES:
        import torch

        low, high = _PLANES[bits]
        return torch.cat([pack(codes & ((1 << low) - 1), low), pack(codes >> low, high)], dim=-1)
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"the last dimension ({codes.shape[-1]}) must be a multiple of {per} to pack {bits}-bit codes")
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    packed = grouped[..., 0].clone()
    for i in range(1, per):
        packed |= grouped[..., i] << (bits * i)
    return packed.contiguous()


def unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    import torch

    if bits == 8:
        return packed
    if bits in _PLANES:
        low, high = _PLANES[bits]
        n = d * low // 8
        out = unpack(packed[..., :n], low, d)
        return out.bitwise_or_(unpack(packed[..., n:], high, d).bitwise_left_shift_(low))
    if bits == 1:  # numpy's unpackbits, least significant bit first (pack's order): one pass, not eight
        import numpy as np

        bits_out = np.unpackbits(packed.numpy(), axis=-1, bitorder="little")
        return torch.from_numpy(bits_out).view(*packed.shape[:-1], d)
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
