"""Readers for the public evaluation data rag-opt trains and measures on (HotpotQA, SQuAD 2.0, NQ multi-doc).

Only the standard library is used; files are gzip'd JSON / JSONL as published. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rag_opt.errors import DataNotFoundError, InvalidInputError

__all__ = [
    "HotpotExample",
    "NQExample",
    "contains_answer",
    "data_dir",
    "iter_squad",
    "normalize_answer",
    "nq_split",
    "read_hotpotqa",
    "read_jsonl",
    "read_nq_multidoc",
]


def data_dir(default: str | Path) -> Path:
    """``$RAG_OPT_DATA_DIR`` when set, else ``default``: the library has no data location of its own (the CLI,
    tests and benchmarks pass ``../shared/data``)."""
    env = os.environ.get("RAG_OPT_DATA_DIR")
    return Path(env) if env else Path(default)


@dataclass(frozen=True)
class HotpotExample:
    id: str
    question: str
    answer: str
    type: str
    titles: list[str]
    sentences: list[list[str]]  # per paragraph, sentences with their leading spaces
    supporting: set[tuple[int, int]]  # (paragraph index, sentence index)

    @property
    def yes_no(self) -> bool:
        return normalize_answer(self.answer) in ("yes", "no")

    def paragraph_text(self, p: int) -> str:
        return "".join(self.sentences[p])


def read_hotpotqa(path: str | Path, *, limit: int | None = None, seed: int | None = None) -> list[HotpotExample]:
    """Read a HotpotQA JSONL(.gz) file. With ``seed``, the examples are shuffled deterministically first."""
    out: list[HotpotExample] = []
    with _open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            titles = [t for t, _ in rec["context"]]
            sentences = [list(s) for _, s in rec["context"]]
            index = {t: i for i, t in enumerate(titles)}
            sup = {
                (index[t], int(k))
                for t, k in rec["supporting_facts"]
                if t in index and int(k) < len(sentences[index[t]])
            }
            out.append(
                HotpotExample(rec["_id"], rec["question"], rec["answer"], rec.get("type", ""), titles, sentences, sup)
            )
    if seed is not None:
        random.Random(seed).shuffle(out)
    return out[:limit] if limit is not None else out


def iter_squad(path: str | Path) -> Iterator[tuple[str, str, dict[str, object]]]:
    """Yield (title, paragraph context, qa) for every question of a SQuAD 2.0 file."""
    with _open(path) as fh:
        data = json.load(fh)
    for article in data["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                yield article["title"], para["context"], qa


def read_jsonl(path: str | Path) -> Iterator[dict[str, object]]:
    with _open(path) as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def _open(path: str | Path) -> IO[str]:
    p = Path(path)
    if not p.is_file():
        raise DataNotFoundError(f"data file not found: {p}")
    if p.suffix == ".gz":
        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, encoding="utf-8")


def normalize_answer(s: str) -> str:
    """SQuAD answer normalisation: lower case, no punctuation, articles or extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def contains_answer(text: str, answer: str) -> bool:
    norm = normalize_answer(answer)
    return bool(norm) and norm in normalize_answer(text)


@dataclass(frozen=True)
class NQExample:
    """A Lost-in-the-Middle NQ multi-document record: question, answers, gold passage, ranked distractors."""

    index: int
    question: str
    answers: list[str]
    gold: dict[str, str]
    distractors: list[dict[str, str]]

    def documents(self, n_docs: int, gold_at: int | None) -> list[dict[str, str]]:
        """``n_docs`` passages, the gold one at ``gold_at`` (None: distractors only), as in Liu et al. (2023)."""
        k = n_docs - (0 if gold_at is None else 1)
        if len(self.distractors) < k:
            raise InvalidInputError(f"record {self.index} has {len(self.distractors)} distractors, {k} needed")
        docs = [dict(d) for d in self.distractors[:k]]
        if gold_at is not None:
            if not 0 <= gold_at < n_docs:
                raise InvalidInputError(f"gold position {gold_at} outside 0..{n_docs - 1}")
            docs.insert(gold_at, dict(self.gold))
        return docs


def read_nq_multidoc(path: str | Path, *, min_distractors: int = 19) -> list[NQExample]:
    """Read ``nq_multidoc/public.jsonl.gz``, skipping records with fewer than ``min_distractors`` distractors."""
    out = []
    for i, rec in enumerate(read_jsonl(path)):
        distractors = rec["distractor_ctxs"]
        assert isinstance(distractors, list)
        if len(distractors) < min_distractors:
            continue
        gold = rec["gold_ctx"]
        assert isinstance(gold, dict)
        answers = rec["answers"]
        assert isinstance(answers, list)
        out.append(
            NQExample(
                index=i,
                question=str(rec["question"]),
                answers=[str(a) for a in answers],
                gold={"title": str(gold["title"]), "text": str(gold["text"])},
                distractors=[{"title": str(d["title"]), "text": str(d["text"])} for d in distractors],
            )
        )
    return out


def nq_split(examples: list[NQExample], part: str) -> list[NQExample]:
    """A fixed split of the NQ records: ``calibration`` (index % 10 == 0: non-relevant passages for position
    profiles), ``train`` (index % 10 in 1..4) and ``test`` (index % 10 >= 5: measured, never trained on)."""
    parts = {"calibration": range(0, 1), "train": range(1, 5), "test": range(5, 10)}
    if part not in parts:
        raise InvalidInputError(f"unknown split {part!r}; use one of {list(parts)}")
    return [ex for ex in examples if ex.index % 10 in parts[part]]
