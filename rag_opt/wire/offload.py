"""Work that must not stall an event loop (parsing and rewriting large request bodies, checking large responses):
:func:`off_loop` runs it inline when small, else on one of anyio's worker threads. The server and the gateway
adapter both run the core's steps through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["INLINE_BYTES", "off_loop"]

T = TypeVar("T")
INLINE_BYTES = 64 * 1024  # inputs larger than this are handled on a worker thread by off_loop


async def off_loop(size: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` inline for small inputs (``size`` up to :data:`INLINE_BYTES`), on a worker thread for large
    ones (the event loop never stalls)."""
    if size <= INLINE_BYTES:
        return fn()
    import anyio.to_thread  # (only here: the core imports no event-loop library until it needs a thread)

    return await anyio.to_thread.run_sync(fn)
