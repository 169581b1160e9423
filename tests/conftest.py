from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def proxy():
    from rag_opt.models.loader import load_proxy_model

    return load_proxy_model()
