"""The cache codes' packing and decoding primitives (rag_opt.models.kv_quant) against plain references."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rag_opt.models import kv_quant  # noqa: E402


def _reference_unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Bit by bit, least significant code first (pack's order); two planes for 3, 5 and 6 bits."""
    planes = {3: (2, 1), 5: (4, 1), 6: (4, 2)}
    if bits in planes:
        low, high = planes[bits]
        n = d * low // 8
        return _reference_unpack(packed[..., :n], low, d) + (_reference_unpack(packed[..., n:], high, d) << low)
    if bits == 8:
        return packed
    per = 8 // bits
    cols = [(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    return torch.stack(cols, dim=-1).reshape(*packed.shape[:-1], d)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
def test_unpack_inverts_pack_and_matches_the_bitwise_reference(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 2, 41, 64), dtype=torch.uint8, generator=g)
    packed = kv_quant.pack(codes, bits)
    for view in (packed, packed[:2], packed[:, 1:]):  # slices of a stored entry (its first layers) decode alike
        got = kv_quant.unpack(view, bits, 64)
        assert torch.equal(got, _reference_unpack(view, bits, 64))
    assert torch.equal(kv_quant.unpack(packed, bits, 64), codes)


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_decoding_per_channel_codes_is_code_times_scale_plus_minimum(bits: int) -> None:
    """Codes with one scale per channel (keys) decode to ``code * scale + minimum`` in float32, bit for bit, within
    half a step of what was coded."""
    g = torch.Generator().manual_seed(10 + bits)
    x = torch.randn(4, 3, 50, 64, generator=g) * 3
    tensors: dict[str, torch.Tensor] = {}
    kv_quant.quant(x, bits, dim=2, prefix="k", out=tensors)
    got = kv_quant.dequantized(tensors, "k", bits, 64, 3)
    codes = _reference_unpack(tensors["k"][:3], bits, 64)
    want = codes.float() * tensors["k_scale"][:3].float() + tensors["k_min"][:3].float()
    assert torch.equal(got, want)
    assert (got - x[:3]).abs().max() <= tensors["k_scale"].float().max() / 2 + 1e-6
