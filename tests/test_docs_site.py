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


def _module_map() -> list[str]:
    """The files named by the module map of docs/how-it-works.md (the code block that starts ``rag_opt/``): a line
    ``name/`` opens a folder, a line ``name.py`` names a module, each inside the folder above it by indentation."""
    text = (ROOT / "docs" / "how-it-works.md").read_text(encoding="utf-8")
    block = text.split("```\nrag_opt/\n", 1)[1].split("```", 1)[0]
    folders: list[tuple[int, str]] = [(0, "rag_opt")]
    named = []
    for line in block.splitlines():
        name = line.split()[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        if not (name.endswith("/") or name.endswith(".py")) or indent >= 30:  # a description's second line
            continue
        while folders[-1][0] >= indent:
            folders.pop()
        path = "/".join(f for _, f in folders) + "/" + name
        if name.endswith("/"):
            folders.append((indent, path.rstrip("/").rsplit("/", 1)[1]))
        else:
            named.append(path)
    return named


def test_the_module_map_names_every_module_once() -> None:
    """docs/how-it-works.md's module map lists every module of rag_opt, one line each, and nothing that is gone."""
    named = _module_map()
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "rag_opt").rglob("*.py"))
    assert len(named) == len(set(named)), sorted({n for n in named if named.count(n) > 1})
    assert not sorted(set(modules) - set(named)), f"missing from the module map: {sorted(set(modules) - set(named))}"
    assert not sorted(set(named) - set(modules)), (
        f"in the module map, not in rag_opt: {sorted(set(named) - set(modules))}"
    )
