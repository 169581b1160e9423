"""Shared test helpers: where the real data lives (../shared/data next to the repo) and HotpotQA readers."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rag_opt.wire.json_edit import JsonEditor, JsonPath

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


# a tool result of 60 product records, as a JSON array and as a CSV table ("How much does item 42 cost?")
CATEGORIES = ("tools", "garden", "kitchen")
RECORDS = [
    {
        "id": i,
        "name": f"item {i}",
        "category": CATEGORIES[i % 3],
        "price": round(3.5 + i * 1.25, 2),
        "stock": i * 7 % 50,
    }
    for i in range(1, 61)
]
RECORDS_JSON = json.dumps(RECORDS, indent=2)  # 60 records, ~6,400 characters
CSV_HEADER = "id,name,category,price,stock"
CSV_ROWS = [f"{r['id']},{r['name']},{r['category']},{r['price']:.2f},{r['stock']}" for r in RECORDS]
RECORDS_CSV = CSV_HEADER + "\n" + "\n".join(CSV_ROWS)  # ~2,000 characters


def data_path(*parts: str) -> Path:
    path = DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data not available: {path} is absent (expected ../shared/data next to the repo)")
    return path


def hotpot_dev(n: int) -> list[dict]:
    out = []
    with gzip.open(data_path("hotpotqa", "dev.jsonl.gz"), "rt") as fh:
        for line in fh:
            out.append(json.loads(line))
            if len(out) >= n:
                break
    return out


def hotpot_docs(ex: dict) -> list[dict]:
    return [
        {"id": title, "title": title, "text": "".join(sents), "metadata": {"title": title, "n": i}}
        for i, (title, sents) in enumerate(ex["context"])
    ]


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_DOCS = [
    json.loads(line) for line in (EXAMPLES / "hotpotqa_docs.jsonl").read_text().splitlines() if line.strip()
]
EXAMPLE_QUESTION = (EXAMPLES / "hotpotqa_question.txt").read_text().strip()


def blocks(docs: list[dict[str, Any]]) -> str:
    """Documents as ``<document id=".." title="..">`` blocks, one per line."""
    return "\n".join(f'<document id="{d["id"]}" title="{d["title"]}">\n{d["text"]}\n</document>' for d in docs)


def assert_verbatim(kept: str, source: str) -> None:
    """``kept`` is pieces of ``source`` (each at least a few words), verbatim and in order."""
    pos, i = 0, 0
    while i < len(kept):
        lo, hi = i + 1, len(kept)  # longest kept[i:j] found in source[pos:] (presence is monotone in j)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if kept[i:mid] in source[pos:] else (lo, mid - 1)
        piece = kept[i:lo]
        assert piece in source[pos:] and (len(piece) >= 12 or lo == len(kept)), f"not verbatim: {kept[i:]!r}"
        pos = source.index(piece, pos) + len(piece)
        i = lo


# -- request bodies through the proxy (JSON paths of rag_opt.wire.json_edit) -----------------------------------
def value(body: bytes, path: JsonPath) -> Any:
    span = JsonEditor(body.decode()).span(path)
    assert span is not None, f"{path} is not in the body"
    return json.loads(body.decode()[span[0] : span[1]])


def assert_only_context_changed(sent: bytes, got: bytes, paths: list[JsonPath]) -> None:
    """``got`` is ``sent`` with the strings at ``paths`` compressed: each new value is pieces of the old one,
    verbatim and in order (a document may be kept whole), together shorter, and every byte between them is the
    same."""
    a, b = JsonEditor(sent.decode()), JsonEditor(got.decode())
    spans = sorted((a.span(p), b.span(p)) for p in paths)
    pos_a = pos_b = 0
    for sa, sb in spans:
        assert sa is not None and sb is not None
        assert a.text[pos_a : sa[0]] == b.text[pos_b : sb[0]]
        old, new = json.loads(a.text[sa[0] : sa[1]]), json.loads(b.text[sb[0] : sb[1]])
        assert isinstance(new, str)
        assert_verbatim(new, old)
        pos_a, pos_b = sa[1], sb[1]
    assert a.text[pos_a:] == b.text[pos_b:]
    assert len(b.text) < len(a.text)


def assert_optimized(headers: Any) -> None:
    assert headers["x-ragopt-status"] == "optimized"
    assert 0 < int(headers["x-ragopt-tokens-after"]) < int(headers["x-ragopt-tokens-before"])


class Recording:
    """An optimizer for the server tests: passes every call on to ``inner`` and records its keyword arguments."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[dict[str, Any]] = []

    def optimize(self, query: str, documents: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self.inner.optimize(query, documents, **kwargs)

    def lexical_scorer(self) -> Any:
        return self.inner.lexical_scorer()


def cpu_seconds(fn: Callable[[], object], repeat: int = 3) -> float:
    """The least CPU time of this thread over ``repeat`` runs of ``fn`` (other processes on the machine do not
    count): for ratios of two sizes measured in the same test, never for absolute budgets."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def pieces_in_order(kept: str, source: str) -> bool:
    """``kept`` is made of pieces of ``source`` (split at spaces), verbatim and in order."""
    pos = 0
    for piece in [p for p in kept.split(" ") if p]:
        i = source.find(piece, pos)
        if i < 0:
            return False
        pos = i + len(piece)
    return True
