"""Attention sorting (Peysakhovich & Lerer 2023): let the model's own attention decide the order.

Run the model over "documents + question", read the attention each document receives from the final token,
sort so the most-attended document goes last (next to the question), and repeat for a few rounds: each round
sees the documents in the previous round's order. The final order is returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.attention import VIEWS, extract

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.proxy import ProxyModel


class AttentionSort:
    """Attention sorting over ``rounds`` forward passes of a white-box model.

    Args:
        proxy: the loaded model (:func:`rag_opt.proxy.load_proxy`; any Hugging Face causal LM works).
        rounds: sorting rounds (default 2).
        view: ``"last"`` (the final token's attention, as in the paper) or ``"question"``.
        layers / heads: which layers and heads to average (default all).
        max_tokens: the whole context must fit one forward pass of at most this many tokens.
    """

    def __init__(
        self,
        proxy: ProxyModel,
        *,
        rounds: int = 2,
        view: str = "last",
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        max_tokens: int = 8192,
    ) -> None:
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
        for name, sel, n in (("layers", layers, proxy.num_layers), ("heads", heads, proxy.num_heads)):
            if sel is not None and (not sel or any(not 0 <= i < n for i in sel)):
                raise ValueError(f"{name} must be a non-empty list of indices in [0, {n})")
        self.proxy = proxy
        self.rounds = rounds
        self.view = view
        self.layers = list(layers) if layers is not None else None
        self.heads = list(heads) if heads is not None else None
        self.max_tokens = max_tokens
        self.history: list[list[int]] = []

    def scores(self, question: str, documents: Sequence[str]) -> np.ndarray:
        """Attention mass on each document (in the given order), mean over the chosen layers and heads."""
        feats = extract(self.proxy, [[d] for d in documents], question, max_tokens=self.max_tokens)
        if feats.windows > 1:
            raise ValueError(f"the documents do not fit one forward pass of {self.max_tokens} tokens")
        mass = feats.doc_mass[:, VIEWS.index(self.view)]  # (n_docs, L, H)
        if self.layers is not None:
            mass = mass[:, self.layers]
        if self.heads is not None:
            mass = mass[:, :, self.heads]
        return np.asarray(mass.mean(axis=(1, 2)), dtype=np.float64)

    def order(self, question: str, documents: Sequence[str]) -> list[int]:
        """The permutation after ``rounds`` rounds: slot i holds input document ``perm[i]``."""
        perm = list(range(len(documents)))
        self.history = [perm[:]]
        if len(documents) < 2:
            return perm
        for _ in range(self.rounds):
            s = self.scores(question, [documents[i] for i in perm])
            # ascending: the most-attended document goes last; stable for ties
            perm = [perm[j] for j in sorted(range(len(perm)), key=lambda j: (s[j], j))]
            self.history.append(perm[:])
        return perm
