"""NQ multi-document contexts for training: the records (a question, its gold passage and BM25 distractors), the
rendered instances (the gold passage at a chosen slot among ``n_docs``), and their attention features.

Shared by the document probe (:mod:`rag_opt.training.doc_probe`) and the NQ sentence labels
(:mod:`rag_opt.training.nq_sentences`), which the sentence probe reads: they import this module, not each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.training.datasets import NQExample, nq_split, read_nq_multidoc
from rag_opt.training.feature_cache import FeatureCache, FeatureStore, fill_cache
from rag_opt.training.units import titled_units

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.loader import ProxyModel

__all__ = ["NQ_MIN_DISTRACTORS", "NQInstance", "extract_nq", "nq_records", "random_positions"]

NQ_MIN_DISTRACTORS = 29  # the same records for every N (10, 20, 30), as in the benchmark


@dataclass(frozen=True)
class NQInstance:
    """One rendered NQ context: a question with ``n_docs`` passages, the gold one at ``gold_at``."""

    example: NQExample
    n_docs: int
    gold_at: int

    @property
    def id(self) -> str:
        return f"nq{self.example.index}-n{self.n_docs}-g{self.gold_at}"

    def units(self) -> list[list[str]]:
        return titled_units(self.example.documents(self.n_docs, self.gold_at))


def nq_records(path: str | Path, split: str) -> list[NQExample]:
    return nq_split(read_nq_multidoc(path, min_distractors=NQ_MIN_DISTRACTORS), split)


def random_positions(records: Sequence[NQExample], n_docs: int, *, seed: int = 0) -> list[NQInstance]:
    """One instance per record with the gold passage at a uniformly random slot (fixed seed)."""
    rng = np.random.default_rng([seed, n_docs])
    return [NQInstance(ex, n_docs, int(rng.integers(n_docs))) for ex in records]


def extract_nq(
    instances: Sequence[NQInstance],
    cache: FeatureCache | FeatureStore,
    proxy: ProxyModel,
    *,
    max_tokens: int = 8192,
    layers: int | None = None,
    progress: bool = True,
    desc: str = "NQ attention features",
    cross: bool = False,
    encoding: str = "joint",
    encodings: EncodingCache | None = None,
) -> int:
    """Compute (or reuse) attention features (of the first ``layers`` layers; default all) for ``instances``;
    returns how many were computed. ``cross``: with cross-document attention (give it a cache of its own).
    ``encoding``: how the proxy reads each context (give ``parallel`` features a cache of their own).
    ``encodings``: under parallel encoding, the document encodings to reuse (the same passages recur at every N)."""
    from rag_opt.models.extract import extract_batch

    return fill_cache(
        cache,
        [(inst.id, inst.units(), inst.example.question) for inst in instances],
        lambda contexts: extract_batch(
            proxy, contexts, max_tokens=max_tokens, layers=layers, cross=cross, encoding=encoding, cache=encodings
        ),
        shard_size=20,
        progress=progress,
        desc=desc,
    )
