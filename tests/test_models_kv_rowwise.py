"""FBGEMM's fused row decoding: the same numbers as rag-opt's tensor operations, for every cache format."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rag_opt.models import kv_rowwise  # noqa: E402
from rag_opt.models.kv_codec import FORMATS, encode_states  # noqa: E402
from rag_opt.models.kv_quant import pack  # noqa: E402


def _need(bits: int) -> None:
    if kv_rowwise.rowwise_decoder(bits) is None:
        pytest.skip(f"this build of torch has no FBGEMM {bits}-bit row decoding (it decodes without it)")


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rowwise_decode_equals_the_tensor_operations(bits):
    _need(bits)
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 5, 7, 64), generator=g, dtype=torch.uint8)
    scale = (torch.rand((3, 5, 7, 1), generator=g) + 0.01).to(torch.float16)
    lo = (torch.randn((3, 5, 7, 1), generator=g) * 3).to(torch.float16)
    got = kv_rowwise.rowwise_decode(pack(codes, bits), scale, lo, bits, 64)
    assert got is not None and got.shape == (3, 5, 7, 64) and got.dtype == torch.float32
    assert torch.equal(got, codes.float() * scale.float() + lo.float())


def test_rowwise_decode_declines_what_it_cannot_do():
    assert kv_rowwise.rowwise_decoder(3) is None and kv_rowwise.rowwise_decoder(16) is None
    scale = torch.ones((2, 1), dtype=torch.float16)
    assert kv_rowwise.rowwise_decode(torch.zeros((2, 24), dtype=torch.uint8), scale, scale, 3, 64) is None
    empty = torch.zeros((0, 16), dtype=torch.uint8)
    assert kv_rowwise.rowwise_decode(empty, scale[:0], scale[:0], 2, 64) is None


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "bf16"])
def test_every_format_decodes_the_same_with_and_without_it(fmt, monkeypatch):
    _need(2)
    g = torch.Generator().manual_seed(0)
    states = (torch.randn((2, 16, 3, 37, 64), generator=g) * 3).to(torch.bfloat16)
    entry = encode_states(states, fmt)
    fused = torch.empty((2, 16, 3, 37, 64))
    entry.decode_into(fused, 16)
    monkeypatch.setattr(kv_rowwise, "rowwise_decode", lambda *args: None)
    plain = torch.empty((2, 16, 3, 37, 64))
    entry.decode_into(plain, 16)
    assert torch.equal(fused, plain)
