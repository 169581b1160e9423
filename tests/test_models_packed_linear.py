"""Prepacked weights for a question pass's small products: the same numbers as ``F.linear``, on the real model."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import hotpot_dev

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.model


def _bf16_proxy():
    from rag_opt.models.loader import cpu_has_bf16, load_proxy_model

    if not cpu_has_bf16():
        pytest.skip("this CPU has no native bf16: the proxy runs in float32 and nothing is packed")
    return load_proxy_model(dtype="bfloat16")


def _unpack(proxy) -> None:
    """Undo the packing (the modules' own forward again), so a test can compare both ways."""
    from rag_opt.models import packed_linear

    for m in proxy.model.modules():
        m.__dict__.pop("forward", None)
        m.__dict__.pop(packed_linear._PACKED_ATTR, None)
    proxy.model.__dict__.pop(packed_linear._PACKED_LAYERS, None)


def test_packed_products_equal_f_linear_and_large_inputs_keep_it():
    from rag_opt.models.packed_linear import PACKED_MAX_ROWS, pack_linears, packed_layers

    proxy = _bf16_proxy()
    _unpack(proxy)
    assert pack_linears(proxy, 3) == 3 == packed_layers(proxy)
    layers = proxy.model.model.layers
    down = layers[0].mlp.down_proj
    assert "forward" in down.__dict__ and "forward" not in layers[3].mlp.down_proj.__dict__  # only the first 3
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 25, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 40):  # the last one through F.linear
            x = torch.randn((1, rows, down.in_features), generator=g).to(torch.bfloat16)
            assert torch.equal(down(x), torch.nn.functional.linear(x, down.weight))
    assert pack_linears(proxy, 2) == 3  # already deeper: nothing to do
    assert pack_linears(proxy, 5) == 5 and "forward" in layers[4].self_attn.q_proj.__dict__


def test_a_float32_model_is_not_packed():
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.models.packed_linear import pack_linears, packed_layers

    fp32 = load_proxy_model(dtype="float32")
    assert pack_linears(fp32, 4) == 0 and packed_layers(fp32) == -1
    assert "forward" not in fp32.model.model.layers[0].mlp.down_proj.__dict__


def test_question_passes_score_the_same_packed_or_not():
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract
    from rag_opt.models.packed_linear import packed_layers

    proxy = _bf16_proxy()
    (ex,) = hotpot_dev(1)
    docs = [[f"{t}\n", *s] for t, s in ex["context"][:4]]
    cache = EncodingCache(format="k8v2")
    extract(proxy, docs, ex["question"], layers=16, encoding="parallel", cache=cache)  # documents cached
    _unpack(proxy)
    from rag_opt.models import packed_linear

    real = packed_linear.pack_linears
    packed_linear.pack_linears = lambda proxy, depth: 0  # this pass unpacked
    try:
        proxy.question_buffers.clear()
        plain = extract(proxy, docs, ex["question"], layers=16, encoding="parallel", cache=cache)
    finally:
        packed_linear.pack_linears = real
    proxy.question_buffers.clear()
    packed = extract(proxy, docs, ex["question"], layers=16, encoding="parallel", cache=cache)
    assert packed_layers(proxy) == 16
    np.testing.assert_array_equal(packed.unit, plain.unit)
    np.testing.assert_array_equal(packed.doc_mass, plain.doc_mass)
