"""Attention sorting (Peysakhovich & Lerer 2023): let the model's own attention decide the order.

Run the model over "documents + question", read the attention each document receives from the final token,
sort so the most-attended document goes last (next to the question), and repeat for a few rounds: each round
sees the documents in the previous round's order. The final order is returned.

By default a document's score is its share of the final token's attention averaged over all layers and heads,
as in the paper. On a small proxy that average is mostly recency bias, so the score can instead average chosen
``(layer, head)`` pairs of either view: :meth:`AttentionSort.tuned` uses the *retrieval heads* selected for the
model on NQ training questions (shipped with the embedded model's document probe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from rag_opt.artifacts.shipped_probes import retrieval_heads
from rag_opt.errors import InvalidInputError
from rag_opt.models.extract import extract
from rag_opt.models.prompt import VIEWS
from rag_opt.orderers.base import OrdererResources, Ordering, OrderItem, register_orderer

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.loader import ProxyModel

__all__ = ["AttentionSort"]


@register_orderer
class AttentionSort:
    """Attention sorting over ``rounds`` forward passes of a white-box model.

    Args:
        proxy: the loaded model (:func:`rag_opt.models.loader.load_proxy_model`; any Hugging Face causal LM works).
        rounds: sorting rounds (default 2).
        view: ``"last"`` (the final token's attention, as in the paper) or ``"question"``.
        layers / heads: which layers and heads to average (default all).
        head_pairs: explicit ``(layer, head)`` pairs to average instead of ``layers`` × ``heads``.
        max_tokens: the whole context must fit one forward pass of at most this many tokens.
    """

    name: ClassVar[str] = "attention_sort"
    reorders: ClassVar[bool] = True

    def __init__(
        self,
        proxy: ProxyModel,
        *,
        rounds: int = 2,
        view: str = "last",
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        head_pairs: Sequence[tuple[int, int]] | None = None,
        max_tokens: int = 8192,
    ) -> None:
        if rounds < 1:
            raise InvalidInputError(f"rounds must be >= 1, got {rounds}")
        if view not in VIEWS:
            raise InvalidInputError(f"view must be one of {VIEWS}, got {view!r}")
        for name, sel, n in (("layers", layers, proxy.num_layers), ("heads", heads, proxy.num_heads)):
            if sel is not None and (not sel or any(not 0 <= i < n for i in sel)):
                raise InvalidInputError(f"{name} must be a non-empty list of indices in [0, {n})")
        if head_pairs is not None:
            if layers is not None or heads is not None:
                raise InvalidInputError("give head_pairs or layers/heads, not both")
            pairs = [(int(a), int(b)) for a, b in head_pairs]
            if not pairs or any(not (0 <= a < proxy.num_layers and 0 <= b < proxy.num_heads) for a, b in pairs):
                raise InvalidInputError(
                    f"head_pairs must be a non-empty list of (layer, head) with layer < {proxy.num_layers} "
                    f"and head < {proxy.num_heads}"
                )
        self.head_pairs = pairs if head_pairs is not None else None
        self.proxy = proxy
        self.rounds = rounds
        self.view = view
        self.layers = list(layers) if layers is not None else None
        self.heads = list(heads) if heads is not None else None
        self.max_tokens = max_tokens
        self.history: list[list[int]] = []

    @classmethod
    def tuned(cls, proxy: ProxyModel, *, rounds: int = 2, max_tokens: int = 8192) -> AttentionSort:
        """Attention sorting over the model's retrieval heads when they are known (selected on NQ training
        questions and shipped with the model's document probe), else the paper's all-heads average."""
        heads = retrieval_heads(proxy.name)
        if heads is None:
            return cls(proxy, rounds=rounds, max_tokens=max_tokens)
        return cls(proxy, rounds=rounds, view=heads.view, head_pairs=list(heads.head_pairs), max_tokens=max_tokens)

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> AttentionSort:
        return cls.tuned(resources.proxy(), max_tokens=resources.max_tokens)

    def scores(self, question: str, documents: Sequence[str]) -> np.ndarray:
        """Attention mass on each document (in the given order), mean over the chosen layers and heads."""
        feats = extract(self.proxy, [[d] for d in documents], question, max_tokens=self.max_tokens)
        if feats.windows > 1:
            raise InvalidInputError(f"the documents do not fit one forward pass of {self.max_tokens} tokens")
        mass = feats.doc_mass[:, VIEWS.index(self.view)]  # (n_docs, L, H)
        if self.head_pairs is not None:
            picked = np.stack([mass[:, a, b] for a, b in self.head_pairs], axis=1)
            return np.asarray(picked.mean(axis=1), dtype=np.float64)
        if self.layers is not None:
            mass = mass[:, self.layers]
        if self.heads is not None:
            mass = mass[:, :, self.heads]
        return np.asarray(mass.mean(axis=(1, 2)), dtype=np.float64)

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering:
        """The :class:`Ordering` after ``rounds`` rounds over the documents' texts."""
        return Ordering(self.permutation(query, [d.text for d in documents]))

    def permutation(self, question: str, documents: Sequence[str]) -> list[int]:
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
