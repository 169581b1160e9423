"""How to install rag-opt with an extra, as it works where rag-opt runs.

rag-opt's distribution is named :data:`DISTRIBUTION` (``rag-opt`` on the package index is an unrelated project
that also installs as ``rag_opt``: never name it in an install hint). Until it is published, rag-opt is installed
from its checkout, so a hint for an editable install names that checkout.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DISTRIBUTION", "install_hint"]

DISTRIBUTION = "ragsieve"  # free on the package index, and not confusable with the unrelated 'rag-opt'


def install_hint(extra: str) -> str:
    """The pip command that adds ``extra`` (``server``, ``mcp``, ``ray``, ...): from the checkout rag-opt runs from
    (``pip install -e '<checkout>[extra]'``), else from the package index under :data:`DISTRIBUTION`."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install '{DISTRIBUTION}[{extra}]'"
