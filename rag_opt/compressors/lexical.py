"""Cheap lexical relevance: BM25 (the ``bm25s`` library) of texts against a question.

Used as a baseline in the benchmarks and as extra features inside the probe. The corpus is the texts being
scored themselves (the units of one context), so IDF reflects what is distinctive in this context. Stopwords
follow the context's language (:func:`rag_opt.text.language.stopwords`).

Terms are words of two characters or more (:data:`TERMS`, bm25s's default), which keeps prose features as the
probes were trained on them; the rows of structured blocks (JSON items, table rows) are also read with
single-character terms and the pairs of adjacent terms (:data:`RECORD_TERMS`), since a record is often named by
a single character (``item 3``, ``row B``) and by a phrase (``item 26`` against a price of ``26.00``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from rag_opt.text.language import stopwords

__all__ = ["RECORD_TERMS", "TERMS", "bm25_scores", "term_overlap"]

TERMS = r"(?u)\b\w\w+\b"  # words of two characters or more
RECORD_TERMS = r"(?u)\b\w+\b"  # every word, single characters and digits too; adjacent pairs are terms as well


def _bm25s() -> Any:
    import logging

    import bm25s

    # bm25s sets its own logger to DEBUG on import, which floods applications' logs: restore the default.
    lib_logger = logging.getLogger("bm25s")
    if lib_logger.level == logging.DEBUG:
        lib_logger.setLevel(logging.NOTSET)
    return bm25s


TOKEN_MEMO = 16384  # texts whose tokens are remembered (the same documents come back with every question)
MEMO_CHARS = 8192  # longer texts are tokenized every time
_memo: OrderedDict[tuple[str, str, str], list[str]] = OrderedDict()
_memo_lock = threading.Lock()


def _tokens(texts: Sequence[str], language: str, pattern: str = TERMS) -> list[list[str]]:
    """Each text's terms (``pattern``'s words, lowercased, ``language``'s stopwords removed); recently seen texts
    are not tokenized again (a bounded, thread-safe LRU: a warm request re-reads the same documents for a new
    question)."""
    out: list[list[str] | None] = [None] * len(texts)
    with _memo_lock:
        for i, text in enumerate(texts):
            hit = _memo.get((language, pattern, text))
            if hit is not None:
                _memo.move_to_end((language, pattern, text))
                out[i] = hit
    missing = [i for i, toks in enumerate(out) if toks is None]
    if missing:
        bm25s = _bm25s()
        fresh = bm25s.tokenize(
            [texts[i] for i in missing],
            token_pattern=pattern,
            stopwords=list(stopwords(language)),
            return_ids=False,
            show_progress=False,
        )
        with _memo_lock:
            for i, toks in zip(missing, fresh, strict=True):
                terms = list(toks)
                if pattern == RECORD_TERMS:
                    terms += [f"{a} {b}" for a, b in zip(terms, terms[1:], strict=False)]
                out[i] = terms
                if len(texts[i]) <= MEMO_CHARS:
                    _memo[(language, pattern, texts[i])] = terms
                    _memo.move_to_end((language, pattern, texts[i]))
            while len(_memo) > TOKEN_MEMO:
                _memo.popitem(last=False)
    return [list(toks) for toks in out if toks is not None]


def bm25_scores(question: str, texts: Sequence[str], language: str = "en", *, pattern: str = TERMS) -> np.ndarray:
    """BM25 score of each text for the question (0 for texts sharing no term with it), ``language``'s
    stopwords removed; terms are ``pattern``'s words (:data:`TERMS` or :data:`RECORD_TERMS`)."""
    if not texts:
        return np.zeros(0, dtype=np.float32)
    query = _tokens([question], language, pattern)[0]
    retriever = _index(tuple(texts), language, pattern)
    if retriever is None or not query:
        return np.zeros(len(texts), dtype=np.float32)
    vocab = retriever.vocab_dict
    known = [t for t in query if t in vocab]
    if not known:
        return np.zeros(len(texts), dtype=np.float32)
    return np.asarray(retriever.get_scores(known), dtype=np.float32)


INDEX_MEMO = 64  # BM25 indexes of recent text sets (a second question over the same documents reuses one)


@lru_cache(maxsize=INDEX_MEMO)
def _index(texts: tuple[str, ...], language: str, pattern: str = TERMS) -> Any:
    """The BM25 index of ``texts`` (None when no text has a term); it depends on the texts only, so it is
    remembered per text set (bounded; only read afterwards)."""
    bm25s = _bm25s()
    corpus = _tokens(texts, language, pattern)
    if not any(corpus):
        return None
    # bm25s cannot index empty documents: give them a placeholder token that no query contains
    corpus = [toks if toks else ["\x00"] for toks in corpus]
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    return retriever


def term_overlap(question: str, texts: Sequence[str], language: str = "en", *, pattern: str = TERMS) -> np.ndarray:
    """Share of the question's distinct content terms (``pattern``'s words, ``language``'s stopwords removed) in
    each text."""
    if not texts:
        return np.zeros(0, dtype=np.float32)
    q = set(_tokens([question], language, pattern)[0])
    if not q:
        return np.zeros(len(texts), dtype=np.float32)
    return np.asarray([len(q & set(t)) / len(q) for t in _tokens(texts, language, pattern)], dtype=np.float32)
