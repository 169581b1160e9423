"""Shared test helpers: where the real data lives (../shared/data next to the repo) and HotpotQA readers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


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
