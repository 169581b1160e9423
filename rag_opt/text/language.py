"""The language of a context: what sentence segmentation and the BM25 stopwords follow.

A language is an ISO 639 code (``en``, ``de``, ``pt-BR``, ``zh-hans``), given once to
:class:`~rag_opt.ContextOptimizer` (``language=``) or the command line (``--language``). It is used for

* sentence segmentation (``sentencex``): language-specific rules (abbreviations, sentence terminators) for the
  languages it has rules for, its fallback chain for related codes, and its default rules for any other code;
* BM25 stopwords (the lexical features of the probe and the BM25 scorer): the ``bm25s`` list for the languages
  in :data:`STOPWORD_LANGUAGES`; any other language is tokenized without removing stopwords (documented fallback,
  logged once per base code, for at most :data:`MAX_LOGGED_LANGUAGES` of them).

A code is at most :data:`MAX_LANGUAGE_CHARS` characters (a longer one is refused), and an error quotes at most
that much of what it was given.
"""

from __future__ import annotations

import logging
import re
import threading
from functools import lru_cache

from rag_opt.errors import InvalidInputError, InvalidInputTypeError

__all__ = [
    "MAX_LANGUAGE_CHARS",
    "MAX_LOGGED_LANGUAGES",
    "STOPWORD_LANGUAGES",
    "base_language",
    "check_language",
    "stopwords",
]

logger = logging.getLogger(__name__)

# ISO 639 base code -> the name of the stopword list in ``bm25s.stopwords``
STOPWORD_LANGUAGES: dict[str, str] = {
    "da": "STOPWORDS_DANISH",
    "de": "STOPWORDS_GERMAN",
    "en": "STOPWORDS_EN",
    "es": "STOPWORDS_SPANISH",
    "fr": "STOPWORDS_FRENCH",
    "it": "STOPWORDS_ITALIAN",
    "ko": "STOPWORDS_KOREAN",
    "nb": "STOPWORDS_NORWEGIAN",
    "nl": "STOPWORDS_DUTCH",
    "nn": "STOPWORDS_NORWEGIAN",
    "no": "STOPWORDS_NORWEGIAN",
    "pt": "STOPWORDS_PORTUGUESE",
    "ru": "STOPWORDS_RUSSIAN",
    "sv": "STOPWORDS_SWEDISH",
    "tr": "STOPWORDS_TURKISH",
    "zh": "STOPWORDS_CHINESE",
}

# a 2–3 letter ISO 639 code, optionally followed by subtags (script, region, variant): "en", "pt-BR", "zh-hans"
_CODE = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8})*")
MAX_LANGUAGE_CHARS = 64  # BCP 47 asks implementations to take tags of at least 35 characters
MAX_LOGGED_LANGUAGES = 32  # languages without a stopword list that are logged; later ones are not
_logged: set[str] = set()
_logged_lock = threading.Lock()


def _shown(value: str) -> str:
    """``value`` for a message: its repr, cut to :data:`MAX_LANGUAGE_CHARS` characters."""
    if len(value) <= MAX_LANGUAGE_CHARS:
        return repr(value)
    return f"{value[:MAX_LANGUAGE_CHARS]!r}... ({len(value)} characters)"


def check_language(language: object) -> str:
    """``language`` as a lower-case ISO 639 code (``_`` written ``-``), or a clear :class:`InvalidInputError`."""
    if not isinstance(language, str):
        raise InvalidInputTypeError(f"language must be a string such as 'en' or 'de', got {type(language).__name__}")
    code = language.strip()
    if len(code) > MAX_LANGUAGE_CHARS or not _CODE.fullmatch(code):
        raise InvalidInputError(
            f"language must be an ISO 639 code such as 'en', 'de' or 'pt-BR' (at most {MAX_LANGUAGE_CHARS} "
            f"characters), got {_shown(language)}"
        )
    return code.replace("_", "-").lower()


def base_language(language: str) -> str:
    """The base code of a language: ``pt-br`` → ``pt``."""
    return language.split("-", 1)[0].lower()


def stopwords(language: str) -> tuple[str, ...]:
    """The BM25 stopwords of ``language``: the ``bm25s`` list for its base code, else none (logged once per base
    code, for the first :data:`MAX_LOGGED_LANGUAGES` of them)."""
    return _stopwords(base_language(language))


@lru_cache(maxsize=64)  # keyed by the base code: a few bytes each, whatever the codes asked for
def _stopwords(base: str) -> tuple[str, ...]:
    name = STOPWORD_LANGUAGES.get(base)
    words: tuple[str, ...] | None = None
    if name is not None:
        import bm25s.stopwords

        found = getattr(bm25s.stopwords, name, None)
        words = tuple(found) if found is not None else None
    if words is None:
        _log_unlisted(base)
        return ()
    return words


def _log_unlisted(base: str) -> None:
    """Say once that ``base`` has no stopword list; after :data:`MAX_LOGGED_LANGUAGES` languages, say that
    later ones are not logged, and stop (unique codes cannot fill the log)."""
    with _logged_lock:
        if base in _logged or len(_logged) > MAX_LOGGED_LANGUAGES:
            return
        _logged.add(base)
        last = len(_logged) > MAX_LOGGED_LANGUAGES
    if last:
        logger.info("more languages without a BM25 stopword list: not logged any more")
        return
    logger.info(
        "no BM25 stopword list for language %s: its lexical features keep every word (lists exist for %s)",
        _shown(base),
        ", ".join(sorted(STOPWORD_LANGUAGES)),
    )
