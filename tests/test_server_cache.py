"""The server's encoding (``--encoding``) and its one encoding cache (``--no-cache``, ``--cache-bytes``,
``--cache-dir``): the settings, the cache every request shares, the per-request ``x-ragopt-cache-*`` headers and
``/v1/compress`` fields (only with ``--expose-cache-hits``), ``/stats`` and ``/metrics``; end to end with uvicorn, a
recording upstream and the real embedded proxy model. The store tiers and tenants: tests/test_server_cache_tiers.py."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rag_opt.errors import ConfigurationError
from rag_opt.models.encoding_cache import DEFAULT_CACHE_BYTES, EncodingCache
from rag_opt.models.prompt import DEFAULT_ENCODING
from rag_opt.server.settings import ProxySettings
from rag_opt.server.settings_cli import add_settings_arguments, settings_from_args
from rag_opt.server.state import ProxyState, build_encoding_cache
from tests.helpers import EXAMPLE_DOCS, EXAMPLE_QUESTION, blocks
from tests.upstream_server import FakeUpstream, ServerThread, parse_metrics, serve_proxy

UPSTREAM = "http://127.0.0.1:9/v1"
DOCS = EXAMPLE_DOCS[:3]


def settings(argv: list[str], env: dict[str, str] | None = None) -> ProxySettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return settings_from_args(parser.parse_args(["--upstream", UPSTREAM, *argv]), env or {})


# -- settings -------------------------------------------------------------------------------------------------
def test_defaults_and_the_one_cache_the_optimizer_gets(tmp_path: Path) -> None:
    s = settings([])
    assert (s.encoding, s.encoding_cache, s.encoding_cache_bytes, s.encoding_cache_dir) == (
        DEFAULT_ENCODING,
        True,
        DEFAULT_CACHE_BYTES,
        None,
    )
    state = ProxyState(
        settings(["--encoding", "parallel", "--cache-bytes", "1000", "--cache-dir", str(tmp_path)]), None
    )
    try:
        cache = state.cache
        assert isinstance(cache, EncodingCache) and state.optimizer.cache is cache  # type: ignore[attr-defined]
        assert (cache.max_bytes, cache.disk, state.encoding) == (1000, tmp_path, "parallel")
        assert state.optimizer.encoding == "parallel"  # type: ignore[attr-defined]
    finally:
        state.pool.shutdown()


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--encoding", "parallel"], {}, DEFAULT_CACHE_BYTES),
        (["--encoding", "joint"], {}, None),  # joint encoding has nothing to cache
        (["--encoding", "parallel", "--no-cache"], {}, None),
        (["--encoding", "parallel"], {"RAG_OPT_ENCODING_CACHE": "false"}, None),
        (["--encoding", "parallel", "--cache-bytes", "0"], {}, None),  # nothing could be kept
        ([], {"RAG_OPT_ENCODING": "parallel", "RAG_OPT_ENCODING_CACHE_BYTES": "4096"}, 4096),
        # RAG_OPT_CACHE_DIR is rag-opt's general cache folder: it never turns the disk tier on
        (["--encoding", "parallel"], {"RAG_OPT_CACHE_DIR": "/tmp/elsewhere"}, DEFAULT_CACHE_BYTES),
    ],
)
def test_which_cache_the_settings_build(argv: list[str], env: dict[str, str], expected: int | None) -> None:
    cache = build_encoding_cache(settings(argv, env))
    assert (cache.max_bytes if cache is not None else None) == expected
    assert cache is None or cache.disk is None


def test_the_decoded_entries_bound_from_the_flag_or_the_variable(tmp_path: Path) -> None:
    from rag_opt.models.decoded_entries import DEFAULT_DECODED_BYTES

    def bound(argv: list[str], env: dict[str, str] | None = None) -> int:
        cache = build_encoding_cache(settings(["--encoding", "parallel", *argv], env))
        assert cache is not None
        return cache.decoded.max_bytes

    assert bound([]) == DEFAULT_DECODED_BYTES
    assert bound(["--cache-decoded-bytes", "1000"]) == 1000
    assert bound([], {"RAG_OPT_ENCODING_CACHE_DECODED_BYTES": "0"}) == 0
    assert bound(["--cache-bytes", "0", "--cache-dir", str(tmp_path)]) == 0  # no memory tier: none kept
    with pytest.raises(ConfigurationError, match=r"encoding_cache_decoded_bytes \(from --cache-decoded-bytes\)"):
        settings(["--cache-decoded-bytes", "-1"])


def test_a_disk_tier_alone(tmp_path: Path) -> None:
    cache = build_encoding_cache(
        settings(
            [],
            {
                "RAG_OPT_ENCODING": "parallel",
                "RAG_OPT_ENCODING_CACHE_BYTES": "0",
                "RAG_OPT_ENCODING_CACHE_DIR": str(tmp_path),
            },
        )
    )
    assert cache is not None and (cache.max_bytes, cache.disk) == (0, tmp_path)


def test_invalid_cache_settings_are_refused_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"invalid encoding \(from RAG_OPT_ENCODING\): must be one of parallel, joint, got 'bogus'",
    ):
        settings([], {"RAG_OPT_ENCODING": "bogus"})
    with pytest.raises(SystemExit):
        settings(["--encoding", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    with pytest.raises(
        ConfigurationError, match=r"encoding_cache_bytes \(from --cache-bytes\): .*greater than or equal to 0"
    ):
        settings(["--cache-bytes", "-1"])
    with pytest.raises(ConfigurationError, match=r"from RAG_OPT_ENCODING_CACHE_BYTES"):
        settings([], {"RAG_OPT_ENCODING_CACHE_BYTES": "lots"})
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ConfigurationError, match=r"from --cache-dir\): .* is not a folder"):
        settings(["--cache-dir", str(a_file)])


def test_serve_help_names_the_cache_options() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    text = parser.format_help()
    for flag in ("--encoding {parallel,joint}", "--no-cache", "--cache-bytes BYTES", "--cache-dir DIR"):
        assert flag in text
    assert "RAG_OPT_ENCODING_CACHE_DIR" in text.replace("\n", "").replace(" ", "")


# -- end to end -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server.url


def chat(url: str, docs: list[dict[str, Any]]) -> httpx.Response:
    content = f"Answer from these documents only.\n\n{blocks(docs)}\n\nQuestion: {EXAMPLE_QUESTION}"
    body = {"model": "fake-llm", "messages": [{"role": "user", "content": content}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=None)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.model
def test_requests_share_the_cache_and_report_their_hits(upstream: tuple[FakeUpstream, str], tmp_path: Path) -> None:
    with serve_proxy(
        upstream[1], None, encoding="parallel", encoding_cache_dir=str(tmp_path), expose_cache_hits=True
    ) as (url, state):
        first, second = chat(url, DOCS), chat(url, DOCS)
        for r in (first, second):
            assert r.headers["x-ragopt-status"] == "optimized" and r.headers["x-ragopt-encoding"] == "parallel"
        assert (first.headers["x-ragopt-cache-hits"], first.headers["x-ragopt-cache-misses"]) == ("0", str(len(DOCS)))
        assert (second.headers["x-ragopt-cache-hits"], second.headers["x-ragopt-cache-misses"]) == (str(len(DOCS)), "0")
        # on disk: each block's states and its sentence ends' queries (the probe reads the cross-document reading),
        # and the prefix (written in the background: waited for)
        assert state.cache.flush(60)
        assert len(list(tmp_path.glob("??/*.safetensors"))) == 2 * len(DOCS) + 1

        docs = [{"text": d["text"], "id": d["id"], "title": d["title"]} for d in DOCS]
        compressed = httpx.post(f"{url}/v1/compress", json={"question": "Who?", "documents": docs}, timeout=None)
        out = compressed.json()
        assert out["status"] == "optimized" and out["encoding"] == "parallel"
        assert (out["cache_hits"], out["cache_misses"]) == (len(DOCS), 0)  # a new question over cached documents
        lexical = httpx.post(
            f"{url}/v1/compress", json={"question": "Who?", "documents": docs, "tier": "lexical"}, timeout=None
        ).json()
        assert lexical["tier"] == "lexical" and lexical["encoding"] is None and lexical["cache_hits"] is None

        stats = httpx.get(f"{url}/stats").json()
        assert stats["encoding"] == "parallel"
        assert stats["encoding_cache"] == state.cache.stats().to_dict()
        cache_stats = stats["encoding_cache"]
        assert cache_stats["hits"] >= 2 * len(DOCS) and cache_stats["entries"] == 2 * len(DOCS) + 1

        metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
        assert metrics["ragopt_encoding_cache_hits_total"] == stats["encoding_cache"]["hits"]
        assert metrics["ragopt_encoding_cache_misses_total"] == stats["encoding_cache"]["misses"]
        assert metrics["ragopt_encoding_cache_disk_writes_total"] == 2 * len(DOCS) + 1
        for name in ("disk_hits_total", "disk_corrupt_total", "evictions_total"):
            assert metrics[f"ragopt_encoding_cache_{name}"] == 0
        assert metrics["ragopt_encoding_cache_entries"] == 2 * len(DOCS) + 1
        assert metrics["ragopt_encoding_cache_bytes"] == stats["encoding_cache"]["bytes"] > 0
        assert metrics["ragopt_encoding_cache_max_bytes"] == DEFAULT_CACHE_BYTES


@pytest.mark.model
@pytest.mark.parametrize("bound", [0, 64 << 20])
def test_decoded_entries_keep_their_bound_and_show_in_metrics(upstream: tuple[FakeUpstream, str], bound: int) -> None:
    """Documents read again in a new set are copied from their kept decoded states (the default format is compact),
    within --cache-decoded-bytes; 0 keeps none, and every read decodes."""
    with serve_proxy(upstream[1], None, encoding="parallel", encoding_cache_decoded_bytes=bound) as (url, state):
        for docs in (DOCS[:2], DOCS[2:], DOCS[:2]):  # the last set is read again into a new buffer
            assert chat(url, docs).headers["x-ragopt-status"] == "optimized"
        stats = state.cache.stats()
        metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
        assert metrics["ragopt_encoding_cache_decoded_max_bytes"] == stats.decoded_max_bytes == bound
        assert metrics["ragopt_encoding_cache_decoded_bytes"] == stats.decoded_bytes <= bound
        assert metrics["ragopt_encoding_cache_decoded_entries"] == stats.decoded_entries
        assert metrics["ragopt_encoding_cache_decoded_hits_total"] == stats.decoded_hits
        if bound:
            assert stats.decoded_hits >= 3  # the prefix and both documents of the first set
            assert stats.decoded_entries >= len(DOCS) + 1 and stats.decoded_bytes > 0
        else:
            assert stats.decoded_hits == stats.decoded_entries == stats.decoded_bytes == 0
        state.cache.close()


@pytest.mark.model
def test_no_per_request_counters_unless_the_operator_exposes_them(upstream: tuple[FakeUpstream, str]) -> None:
    """Hits and misses tell a client whether anyone sent a document recently: by default they are not sent, though
    the cache serves hits (its own counters, /stats and /metrics, are the operator's)."""
    with serve_proxy(upstream[1], None, encoding="parallel") as (url, state):
        assert not state.settings.expose_cache_hits
        first, second = chat(url, DOCS[:2]), chat(url, DOCS[:2])
        for r in (first, second):
            assert r.headers["x-ragopt-status"] == "optimized" and r.headers["x-ragopt-encoding"] == "parallel"
            assert "x-ragopt-cache-hits" not in r.headers and "x-ragopt-cache-misses" not in r.headers
        docs = [{"text": d["text"], "id": d["id"], "title": d["title"]} for d in DOCS[:2]]
        out = httpx.post(f"{url}/v1/compress", json={"question": "Who?", "documents": docs}, timeout=None).json()
        assert out["status"] == "optimized" and out["encoding"] == "parallel"
        assert (out["cache_hits"], out["cache_misses"]) == (None, None)
        assert state.cache.stats().memory_hits >= 2 * 2  # the second request and the compress one were hits
        state.cache.close()


@pytest.mark.model
def test_joint_encoding_reports_no_cache(upstream: tuple[FakeUpstream, str]) -> None:
    with serve_proxy(upstream[1], None, encoding="joint") as (url, state):
        r = chat(url, DOCS[:2])
        assert r.headers["x-ragopt-encoding"] == "joint" and "x-ragopt-cache-hits" not in r.headers
        stats = httpx.get(f"{url}/stats").json()
        assert (stats["encoding"], stats["encoding_cache"]) == ("joint", None) and state.cache is None
        assert parse_metrics(httpx.get(f"{url}/metrics").text)["ragopt_encoding_cache_hits_total"] == 0
