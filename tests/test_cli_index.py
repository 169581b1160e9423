"""``rag-opt index`` (parallel document encodings of a corpus into the encoding cache's disk tier) and
``rag-opt cache stats|clear``, with the real embedded proxy model on real HotpotQA dev paragraphs: the keys the
index writes are the ones a request computes (every document a cache hit afterwards)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from rag_opt.cli import main
from rag_opt.install import install_hint
from tests.helpers import hotpot_dev, hotpot_docs

pytestmark = [pytest.mark.model, pytest.mark.data]


@pytest.fixture(scope="module")
def example() -> tuple[str, list[dict[str, Any]]]:
    ex = hotpot_dev(1)[0]
    return ex["question"], hotpot_docs(ex)[:4]


def write_corpus(path: Path, docs: list[dict[str, Any]], bad: list[str] = ()) -> Path:  # type: ignore[assignment]
    lines = [json.dumps({"id": d["id"], "title": d["title"], "text": d["text"], "url": "ignored"}) for d in docs]
    path.write_text("\n".join([*lines, *bad]) + "\n", encoding="utf-8")
    return path


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("??/*.safetensors"))


def summary(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("rag-opt index:"))


def test_index_writes_the_keys_requests_read_resumes_and_clears(
    tmp_path: Path, example: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    from rag_opt import ContextOptimizer
    from rag_opt.models.encoding_cache import EncodingCache

    question, docs = example
    corpus, cache_dir = write_corpus(tmp_path / "corpus.jsonl", docs), tmp_path / "cache"
    assert main(["index", "-i", str(corpus), "--cache-dir", str(cache_dir), "--no-progress"]) == 0
    assert summary(capsys.readouterr().out).startswith(
        f"rag-opt index: indexed {len(docs)}, skipped-cached 0, failed 0"
    )
    written = entries(cache_dir)
    assert len(written) >= len(docs) + 1  # every document's block (per depth) and the shared prefix

    # a rerun does no forward pass: everything is on disk already
    assert main(["index", "-i", str(corpus), "--cache-dir", str(cache_dir), "--no-progress"]) == 0
    assert summary(capsys.readouterr().out).startswith(
        f"rag-opt index: indexed 0, skipped-cached {len(docs)}, failed 0"
    )
    assert entries(cache_dir) == written

    # a request over those documents reads every one of them from the disk tier: the keys match
    cache = EncodingCache(disk=cache_dir)
    result = ContextOptimizer(encoding="parallel", cache=cache).optimize(question, docs, ratio=0.5)
    assert result.encoding == "parallel"
    assert (result.cache_hits, result.cache_misses) == (len(docs), 0)
    assert cache.stats().disk_hits >= len(docs) and cache.stats().disk_writes == 0

    assert main(["cache", "stats", "--cache-dir", str(cache_dir), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == len(written) and stats["bytes"] == sum(p.stat().st_size for p in written)
    assert stats["foreign_files"] == 0
    # more encodings than documents, and the stats say why: each block's states per depth, its source queries (the
    # cross-document reading), and the shared prefix
    kinds = stats["kinds"]
    assert set(kinds) == {"kv", "rows"} and kinds["kv"] + kinds["rows"] == len(written) > len(docs)
    assert kinds["kv"] == len(docs) * len(stats["kv_depths"]) + len(stats["kv_depths"])  # one block each + prefix
    assert kinds["rows"] == len(docs) and sum(stats["kv_depths"].values()) == kinds["kv"]
    assert main(["cache", "stats", "--cache-dir", str(cache_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("bound") and f"{len(written)} encodings" in lines[0]
    assert lines[1].strip().startswith(f"{kinds['kv']} key/value states") and "shared prompt prefix" in lines[1]
    assert lines[2].strip().startswith(f"{kinds['rows']} source-query sets") and "cross-document" in lines[2]

    assert main(["cache", "clear", "--cache-dir", str(cache_dir)]) == 0
    assert f"removed {len(written)} encodings" in capsys.readouterr().out
    assert cache_dir.is_dir() and not any(cache_dir.iterdir())


def test_a_shallower_depth_is_sliced_from_one_deeper_pass(
    tmp_path: Path, example: tuple[str, list[dict[str, Any]]]
) -> None:
    """Two depths indexed from one pass at the deeper: a request at the shallower one hits every document, and
    its features equal those of its own uncached passes."""
    import numpy as np

    from rag_opt.cli.index import DocumentIndexer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.extract import extract_batch
    from rag_opt.text.units import UnitTable
    from rag_opt.types import to_documents

    question, docs = example
    indexer = DocumentIndexer(tmp_path, layers=[3, 6])
    results = indexer.index_rows(list(enumerate(docs, start=1)))
    assert [r.status for r in results] == ["indexed"] * len(docs)
    units = UnitTable.build(to_documents(docs), lambda s: 0).by_document()
    cache = EncodingCache(disk=tmp_path)
    kw: dict[str, Any] = {"layers": 3, "encoding": "parallel", "max_tokens": 8192}
    (cached,) = extract_batch(indexer.proxy, [(units, question)], cache=cache, **kw)
    (fresh,) = extract_batch(indexer.proxy, [(units, question)], cache=None, **kw)
    assert (cached.cache_hits, cached.cache_misses) == (len(docs), 0)
    np.testing.assert_allclose(cached.unit, fresh.unit, rtol=1e-3, atol=1e-5)
    assert indexer.index_rows(list(enumerate(docs, start=1)))[0].status == "cached"


def test_bad_rows_are_reported_with_their_line_and_the_others_indexed(
    tmp_path: Path,
    example: tuple[str, list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, docs = example
    bad = ['{"text": "unterminated', '{"title": "no text"}', '{"text": "   "}']
    corpus = write_corpus(tmp_path / "corpus.jsonl", docs[:2], bad)
    with caplog.at_level(logging.ERROR, logger="rag_opt.cli.index"):
        code = main(["index", "-i", str(corpus), "--cache-dir", str(tmp_path / "c"), "--no-progress"])
    assert code == 1
    assert summary(capsys.readouterr().out).startswith("rag-opt index: indexed 2, skipped-cached 0, failed 3")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3
    assert errors[0].startswith(f"{corpus}, line 3: invalid JSON")
    assert errors[1] == f"{corpus}, line 4: missing string field 'text'"
    assert errors[2] == f"{corpus}, line 5: the document's text is empty"


def test_a_row_past_the_servers_limits_is_that_rows_error_and_the_others_are_written(
    tmp_path: Path,
    example: tuple[str, list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A huge document among good rows (in the same batch) fails alone, before any model work; the good rows of its
    batch are written."""
    _, docs = example
    huge = {"id": "huge", "title": "Huge", "text": " ".join(d["text"] for d in docs) * 40}
    corpus = write_corpus(tmp_path / "corpus.jsonl", [docs[0], huge, docs[1]])
    folder = tmp_path / "c"
    with caplog.at_level(logging.ERROR, logger="rag_opt.cli.index"):
        code = main(
            ["index", "-i", str(corpus), "--cache-dir", str(folder), "--no-progress", "--max-proxy-tokens", "4000"]
        )
    assert code == 1
    assert summary(capsys.readouterr().out).startswith("rag-opt index: indexed 2, skipped-cached 0, failed 1")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "line 2" in errors[0] and "more than the limit of 4000" in errors[0]
    assert entries(folder)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="rag_opt.cli.index"):  # the units limit too
        code = main(["index", "-i", str(corpus), "--cache-dir", str(folder), "--no-progress", "--max-units", "50"])
    assert code == 1
    assert "failed 1" in summary(capsys.readouterr().out)
    assert any("units" in r.getMessage() and "line 2" in r.getMessage() for r in caplog.records)


def test_cache_clear_refuses_a_folder_that_is_not_an_encoding_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "not-a-cache"
    (folder / "ab").mkdir(parents=True)
    (folder / "ab" / "x.safetensors").write_bytes(b"0")
    (folder / "notes.txt").write_text("mine")
    assert main(["cache", "clear", "--cache-dir", str(folder)]) == 2
    assert "does not look like an encoding cache" in capsys.readouterr().err
    assert (folder / "notes.txt").is_file() and (folder / "ab" / "x.safetensors").is_file()
    assert main(["cache", "stats", "--cache-dir", str(tmp_path / "absent")]) == 2
    assert "cache folder not found" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is not None, reason="ray is installed: the message is for its absence"
)
def test_ray_without_the_extra_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('"a document."\n')
    assert main(["index", "-i", str(corpus), "--cache-dir", str(tmp_path / "c"), "--ray"]) == 2
    assert install_hint("ray") in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra (pip install -e '.[ray]')")
def test_index_on_ray_writes_the_same_entries(
    tmp_path: Path, example: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:  # pragma: no cover - ray is not in the dev extra
    _, docs = example
    corpus = write_corpus(tmp_path / "corpus.jsonl", docs[:2])
    assert main(["index", "-i", str(corpus), "--cache-dir", str(tmp_path / "local"), "--no-progress"]) == 0
    assert main(["index", "-i", str(corpus), "--cache-dir", str(tmp_path / "ray"), "--no-progress", "--ray"]) == 0
    assert "indexed 2, skipped-cached 0, failed 0" in capsys.readouterr().out
    assert [p.name for p in entries(tmp_path / "local")] == [p.name for p in entries(tmp_path / "ray")]


def test_two_indexers_on_one_folder_do_not_encode_a_block_twice(
    tmp_path: Path, example: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One indexer holds a block's claim (it is encoding it): the other defers the row, then finds the entry written
    once the first releases, and encodes nothing of it; no claim file is left behind."""
    import rag_opt.models.document_pass as passes
    from rag_opt.cli.index import DocumentIndexer

    _, docs = example
    cache_dir = tmp_path / "cache"
    first, second = DocumentIndexer(cache_dir), DocumentIndexer(cache_dir)
    rows = [(i + 1, d) for i, d in enumerate(docs[:2])]
    assert all(first._claim(b) for b in first.blocks(docs[0]))  # the first indexer is encoding document 0 now

    encoded: list[tuple[int, ...]] = []
    for name in ("encode_blocks", "encode_blocks_with_sources"):
        real = getattr(passes, name)

        def counting(proxy: Any, prefix: Any, blocks: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            encoded.extend(tuple(b) for b in blocks)
            return _real(proxy, prefix, blocks, *args, **kwargs)

        monkeypatch.setattr(passes, name, counting)
    results = second.index_rows(rows)
    assert [(r.line, r.status) for r in results] == [(2, "indexed")]
    assert [line for line, _ in second.deferred] == [1]  # document 0 is left to the first indexer
    held = {b.ids for b in first.blocks(docs[0])}
    assert not held & set(encoded)  # the second indexer did not encode it
    first.release()
    assert [r.status for r in first.index_rows([rows[0]])] == ["indexed"]
    n = len(encoded)
    again, second.deferred = second.deferred, []
    assert [r.status for r in second.index_rows(again, defer=False)] == ["cached"]
    assert len(encoded) == n  # read from the first indexer's entries: nothing encoded twice
    first.close()
    second.close()
    assert not list(cache_dir.rglob("*.claim")) and not list(cache_dir.rglob("*.lock"))
