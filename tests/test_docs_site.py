"""The docs site builds with ``mkdocs build --strict``: a broken link, anchor or API reference fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[dev]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[dev]')")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    built = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "Quickstart" in built and "rag_opt.optimize" in (tmp_path / "site" / "python-api" / "index.html").read_text(
        encoding="utf-8"
    )
