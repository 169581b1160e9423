from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SESSION_CACHE: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """rag-opt's cache folder (``RAG_OPT_CACHE_DIR``) is a temporary one for the session, so calibration profiles,
    feature caches and whatever else the tests write never land in the user's ``~/.cache/rag-opt``; subprocesses
    inherit it. Its ``models`` folder is a link to the user's: the converted proxy models (~0.8 GB, ~20 s to convert)
    are the same files the user's rag-opt loads, keyed by the weights' contents, so sharing them costs nothing and
    converting them again every session would. ``RAG_OPT_TESTS_USER_CACHE_DIR`` names the user's folder."""
    global _SESSION_CACHE
    from rag_opt.paths import cache_dir

    user = cache_dir()
    (user / "models").mkdir(parents=True, exist_ok=True)
    _SESSION_CACHE = Path(tempfile.mkdtemp(prefix="rag-opt-tests-"))
    (_SESSION_CACHE / "models").symlink_to((user / "models").resolve(), target_is_directory=True)
    os.environ["RAG_OPT_TESTS_USER_CACHE_DIR"] = str(user)
    os.environ["RAG_OPT_CACHE_DIR"] = str(_SESSION_CACHE)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE is not None:
        (_SESSION_CACHE / "models").unlink(missing_ok=True)  # the link only: the user's models stay
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def proxy():
    """The embedded proxy model in float32: the tests that compare attention values need exact arithmetic (the
    library's default precision may be bfloat16, see ``rag_opt.models.loader.default_dtype``)."""
    from rag_opt.models.loader import load_proxy_model

    return load_proxy_model(dtype="float32")
