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


def data_dir() -> Path:
    """``$RAG_OPT_DATA_DIR``, else ``../shared/data`` relative to the current directory or this checkout."""
    env = os.environ.get("RAG_OPT_DATA_DIR")
    if env:
        return Path(env)
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        cand = base.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return Path.cwd().parent / "shared" / "data"


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
        raise FileNotFoundError(f"data file not found: {p}")
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
