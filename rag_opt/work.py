"""Bounding and cancelling the work of one optimization: limits checked before the expensive stages, and
checkpoints between stages and between forward passes.

A caller that runs :meth:`rag_opt.ContextOptimizer.optimize` on a thread can open a :func:`scope` on that thread
with :class:`WorkLimits` (question tokens, units, proxy tokens) and a cancel event. The pipeline then checks the
question's length before segmentation, the number of units after it and the number of proxy tokens (the context's
and the question's, once per forward pass it goes into) before the first forward pass (raising
:class:`~rag_opt.errors.WorkLimitExceeded`), and calls :func:`checkpoint` between its stages and between the
windows of the proxy model, which raises :class:`~rag_opt.errors.Cancelled` once the event is set. The proxy
server (``rag-opt serve``) uses it so that a request cannot hold a worker for long after its time budget ran out or
its client left.

Outside a scope that gives limits, :class:`~rag_opt.ContextOptimizer` opens its own with its ``limits`` (by default
:data:`DEFAULT_LIMITS`, the server's defaults too; ``limits=None`` lifts them), so that one huge document cannot
run for an hour unasked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rag_opt.errors import Cancelled, WorkLimitExceeded

__all__ = [
    "DEFAULT_LIMITS",
    "QUESTION_CHARS_PER_TOKEN",
    "WorkLimits",
    "check_proxy_tokens",
    "check_question",
    "check_units",
    "checkpoint",
    "limits_given",
    "progress_shown",
    "scope",
]

# a question longer than this many characters per token of the limit is over it without being counted (natural
# text has about 4 characters per token): counting a huge question would itself be the work the limit prevents
QUESTION_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class WorkLimits:
    """Most units (sentences, titles, ...), proxy-model tokens and question tokens (the target tokenizer's) one
    optimization may process; None: no limit."""

    max_units: int | None = None
    max_proxy_tokens: int | None = None
    max_question_tokens: int | None = None


#: the library's and the server's default limits: about a minute of the embedded model's work on 2 cores at most
#: (cost grows linearly with the context's proxy tokens: docs/python-api.md)
DEFAULT_LIMITS = WorkLimits(max_units=20_000, max_proxy_tokens=65_536, max_question_tokens=1024)


@dataclass(frozen=True)
class _Scope:
    limits: WorkLimits
    cancel: threading.Event | None
    given: bool = False  # a scope on the way here gave limits (the optimizer then does not add its own)
    progress: bool = True  # long work may show a progress bar (a server turns it off)


_NONE = _Scope(WorkLimits(), None)
_local = threading.local()


def _current() -> _Scope:
    scope_: _Scope = getattr(_local, "scope", _NONE)
    return scope_


@contextmanager
def scope(
    *, limits: WorkLimits | None = None, cancel: threading.Event | None = None, progress: bool | None = None
) -> Iterator[None]:
    """Within this block, on this thread: ``limits`` apply, ``cancel`` (once set) cancels, and ``progress`` says
    whether long work may show a progress bar. Nested scopes keep the outer one's unless they give their own."""
    outer = _current()
    _local.scope = _Scope(
        limits if limits is not None else outer.limits,
        cancel if cancel is not None else outer.cancel,
        outer.given or limits is not None,
        outer.progress if progress is None else progress,
    )
    try:
        yield
    finally:
        _local.scope = outer


def limits_given() -> bool:
    """Whether a scope open on this thread gave limits (a server's, or an optimizer's own)."""
    return _current().given


def progress_shown() -> bool:
    """Whether long work on this thread may show a progress bar (off in a scope that says so, e.g. a server's)."""
    return _current().progress


def checkpoint() -> None:
    """Raise :class:`~rag_opt.errors.Cancelled` if this thread's work was cancelled."""
    cancel = _current().cancel
    if cancel is not None and cancel.is_set():
        raise Cancelled("the optimization was cancelled: its caller gave up")


def check_question(question: str, count: Callable[[str], int]) -> None:
    """Raise :class:`~rag_opt.errors.WorkLimitExceeded` if ``question`` has more tokens (by ``count``) than the
    limit in force; one of more than :data:`QUESTION_CHARS_PER_TOKEN` characters per token of the limit is over
    it without being counted."""
    limit = _current().limits.max_question_tokens
    if limit is not None:
        if len(question) > limit * QUESTION_CHARS_PER_TOKEN:
            raise WorkLimitExceeded(
                f"the question has {len(question)} characters, more than the limit of {limit} tokens allows"
            )
        n = count(question)
        if n > limit:
            raise WorkLimitExceeded(f"the question has {n} tokens, more than the limit of {limit}")
    checkpoint()


def check_units(n: int) -> None:
    """Raise :class:`~rag_opt.errors.WorkLimitExceeded` if ``n`` units exceed the limit in force."""
    limit = _current().limits.max_units
    if limit is not None and n > limit:
        raise WorkLimitExceeded(f"the context has {n} units (sentences, titles, ...), more than the limit of {limit}")
    checkpoint()


def check_proxy_tokens(n: int) -> None:
    """Raise :class:`~rag_opt.errors.WorkLimitExceeded` if ``n`` proxy-model tokens exceed the limit in force."""
    limit = _current().limits.max_proxy_tokens
    if limit is not None and n > limit:
        raise WorkLimitExceeded(f"the context has {n} proxy tokens, more than the limit of {limit}")
    checkpoint()
