"""The disk tier's sizes: its default bound, :data:`DEFAULT_DISK_BYTES`, and byte counts read from text
(:func:`parse_size`: ``8GiB``, ``500MB``). Both are re-exported by :mod:`rag_opt.models.cache_disk`."""

from __future__ import annotations

import re

from rag_opt.errors import InvalidInputError

__all__ = ["DEFAULT_DISK_BYTES", "parse_size"]

DEFAULT_DISK_BYTES = 8 * 2**30  # 8 GiB (see :mod:`rag_opt.models.cache_disk`)

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int) -> int:
    """A byte count from ``text``: plain bytes (``"1048576"``), or a size with a unit: ``KiB``, ``MiB``, ``GiB``,
    ``TiB`` (powers of 1024), ``kB``, ``MB``, ``GB``, ``TB`` (powers of 1000), ``K``, ``M``, ``G``, ``T`` alone
    (powers of 1024); case-insensitive, decimals allowed (``1.5GiB``). Raises :class:`InvalidInputError`."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidInputError(f"a size must be >= 0, got {text}")
        return text
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise InvalidInputError(f"expected a size in bytes (e.g. 1048576, 500MB, 8GiB), got {text!r}")
    number, prefix, binary, unit_b = match.groups()
    if binary and not prefix:
        raise InvalidInputError(f"expected a size in bytes (e.g. 1048576, 500MB, 8GiB), got {text!r}")
    decimal = bool(prefix) and bool(unit_b) and not binary  # kB, MB, GB: powers of 1000; K, KiB: of 1024
    scale = (1000 if decimal else 1024) ** _POWERS[prefix.lower()]
    return int(number) * scale if number.isdigit() else int(float(number) * scale)
