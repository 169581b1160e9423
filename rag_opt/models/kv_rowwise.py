"""Per-row codes decoded in one fused kernel: FBGEMM's row-wise unpacking.

A cache entry's values (and rotated keys) are quantized per row: each token's vector of one layer and head shares a
float16 scale and minimum (:func:`rag_opt.models.kv_quant.quant` along the last axis). Decoding them with tensor
operations takes one pass over the row per step (unpack the bits, convert, scale, shift): four to seven passes,
most of a warm request's decoding with ``k8v2`` entries (the default until 2026-12-06). FBGEMM, which PyTorch's x86
builds include, decodes exactly this layout in one pass: the row-wise 8-, 4- and 2-bit formats of its quantized
embedding tables (each row's codes, then its scale and bias; codes packed low bits first, as rag-opt packs them). It
computes ``code × scale + minimum`` in float32 as the tensor operations do, so the result is the same bit for bit;
that is checked once per bit width and process (:func:`rowwise_decoder`), and a build without FBGEMM, or one whose
results differ, decodes with the tensor operations.

Measured on the CI machine (one thread, a 160-token entry's 15 layers of 2-bit values): 764 → 405 µs with the
rounding to bf16 and the copy into the question buffer included (``benchmarks/warm_path.py`` has the effect on a
warm request).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["rowwise_decode", "rowwise_decoder"]

logger = logging.getLogger(__name__)

_OPS = {8: "embedding_bag_byte_unpack", 4: "embedding_bag_4bit_unpack", 2: "embedding_bag_2bit_unpack"}


def rowwise_decode(
    codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int, d: int
) -> torch.Tensor | None:
    """``codes`` (``(..., d * bits / 8)`` uint8, packed low bits first) with one float16 ``scale`` and ``lo`` per
    row (``(..., 1)``) decoded to ``(..., d)`` float32, or None where FBGEMM cannot (another bit width, no FBGEMM,
    results that would differ, nothing to decode)."""
    op = rowwise_decoder(bits)
    if op is None or not codes.numel() or codes.shape[-1] * 8 != d * bits:
        return None
    return _decode(op, codes, scale, lo, bits).view(*codes.shape[:-1], d)


def _decode(
    op: Callable[[torch.Tensor], torch.Tensor], codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int
) -> torch.Tensor:
    import torch

    rows = codes.reshape(-1, codes.shape[-1])
    # FBGEMM's 8-bit rows carry float32 scale and bias, its 4- and 2-bit rows float16 ones
    wide = torch.float32 if bits == 8 else torch.float16
    s = scale.to(wide).reshape(-1, 1).view(torch.uint8)
    b = lo.to(wide).reshape(-1, 1).view(torch.uint8)
    return op(torch.cat([rows, s, b], dim=1))


@functools.lru_cache(maxsize=8)  # keyed by a bit width: a handful at most
def rowwise_decoder(bits: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """FBGEMM's row-wise unpacking for ``bits``, where present and equal bit for bit to the tensor operations'
    decoding here (checked once), else None."""
    import torch

    name = _OPS.get(bits)
    if name is None:
        return None
    try:
        op: Callable[[torch.Tensor], torch.Tensor] = getattr(torch.ops.quantized, name)
        gen = torch.Generator().manual_seed(bits)
        d = 64
        codes = torch.randint(0, 1 << bits, (300, d), generator=gen, dtype=torch.uint8)
        scale = (torch.rand((300, 1), generator=gen) * 0.3 + 1e-3).to(torch.float16)
        lo = (torch.randn((300, 1), generator=gen) * 4).to(torch.float16)
        per = 8 // bits  # packed as rag-opt packs them: ``per`` consecutive codes a byte, the first in the low bits
        shifts = torch.arange(per, dtype=torch.int32) * bits
        packed = (codes.view(300, d // per, per).to(torch.int32) << shifts).sum(-1).to(torch.uint8)
        got = _decode(op, packed, scale, lo, bits)
        want = codes.float().mul_(scale.float()).add_(lo.float())
        if torch.equal(got, want):
            return op
        logger.debug("FBGEMM's %d-bit row decoding differs from rag-opt's here: not used", bits)
    except (AttributeError, RuntimeError) as exc:  # a build of torch without FBGEMM (e.g. on ARM)
        logger.debug("no FBGEMM %d-bit row decoding: %s", bits, exc)
    return None
