from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def proxy():
    """The embedded proxy model in float32: the tests that compare attention values need exact arithmetic (the
    library's default precision may be bfloat16, see ``rag_opt.models.loader.default_dtype``)."""
    from rag_opt.models.loader import load_proxy_model

    return load_proxy_model(dtype="float32")
