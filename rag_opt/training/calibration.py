"""Estimating position profiles ("found in the middle" calibration), plotting them, and the NQ contexts used.

Training-side code: the runtime only reads profiles (:mod:`rag_opt.artifacts.position_profiles`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rag_opt.artifacts.position_profiles import PositionProfile
from rag_opt.errors import InvalidInputError
from rag_opt.models.prompt import TEMPLATE_ID, VIEWS

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.loader import ProxyModel

__all__ = ["estimate_profile", "nq_calibration_contexts", "plot_profile"]


def estimate_profile(
    proxy: ProxyModel,
    contexts: Iterable[tuple[Sequence[str], str]],
    n_docs: int,
    *,
    max_tokens: int = 8192,
    progress: bool = True,
    metadata: dict[str, Any] | None = None,
) -> PositionProfile:
    """Average the attention share of each slot over contexts of ``n_docs`` non-relevant documents."""
    from tqdm.auto import tqdm

    from rag_opt.models.extract import extract

    total: np.ndarray | None = None
    count = 0
    items = list(contexts)
    for docs, question in tqdm(items, desc=f"calibrating {n_docs} slots", disable=not progress):
        if len(docs) != n_docs:
            raise InvalidInputError(f"calibration context has {len(docs)} documents, expected {n_docs}")
        feats = extract(proxy, [[d] for d in docs], question, max_tokens=max_tokens)
        if feats.windows > 1:
            raise InvalidInputError(
                f"calibration contexts must fit one window ({max_tokens} proxy tokens); got {feats.windows} windows"
            )
        total = feats.doc_mass.astype(np.float64) if total is None else total + feats.doc_mass
        count += 1
    if total is None or count == 0:
        raise InvalidInputError("no calibration contexts")
    return PositionProfile(
        model=proxy.name,
        template=TEMPLATE_ID,
        n_docs=n_docs,
        baseline=total / count,
        contexts=count,
        metadata=dict(metadata or {}),
    )


def plot_profile(profile: PositionProfile, path: str | Path) -> None:
    """A PNG of the per-slot attention (both views, mean over layers and heads): the U-shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    slots = np.arange(1, profile.n_docs + 1)
    for view in VIEWS:
        ax.plot(slots, profile.slot_attention(view), marker="o", label=f"{view} token(s)")
    ax.axhline(1.0 / profile.n_docs, color="grey", ls="--", lw=1, label="even share")
    ax.set_xlabel("document slot")
    ax.set_ylabel("share of context attention")
    ax.set_title(f"Positional attention profile: {profile.model}, {profile.n_docs} docs ({profile.contexts} contexts)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def nq_calibration_contexts(n_docs: int, limit: int, path: str | Path) -> list[tuple[list[str], str]]:
    """Contexts of ``n_docs`` real non-relevant passages: NQ distractors (they do not contain the answer) of the
    NQ records set aside for calibration, each with its own question. A record has at most 29 distractors; larger
    contexts are filled up with the next record's distractors (non-relevant to this question too)."""
    from rag_opt.training.datasets import nq_split, read_nq_multidoc

    src = Path(path)
    records = nq_split(read_nq_multidoc(src, min_distractors=min(n_docs, 29)), "calibration")
    if len(records) < 2 and (not records or len(records[0].distractors) < n_docs):
        raise InvalidInputError(f"not enough NQ calibration records in {src} for {n_docs} documents")
    out = []
    for i, ex in enumerate(records[:limit]):
        docs = [dict(d) for d in ex.distractors[:n_docs]]
        k = i + 1
        while len(docs) < n_docs and k < i + len(records):
            other = records[k % len(records)]
            seen = {d["text"] for d in docs}
            docs += [dict(d) for d in other.distractors if d["text"] not in seen][: n_docs - len(docs)]
            k += 1
        if len(docs) < n_docs:
            raise InvalidInputError(f"not enough NQ distractors in {src} for {n_docs} documents")
        out.append(([f"{d['title']}\n{d['text']}" for d in docs], ex.question))
    return out
