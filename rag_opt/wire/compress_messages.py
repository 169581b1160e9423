"""The messages contract of ``POST /v1/compress`` (Headroom's: ``{"messages": [...], "model"?, "config"?}``)
without its transport: a body read and checked (:func:`read_messages`, :func:`ignored_fields`), each turn with
context and a question as a :class:`MessagesContext` with its :class:`~rag_opt.wire.job.Job`
(:func:`context_jobs`; the turns are :func:`rag_opt.wire.conversation.find_turns`'), the request's status from its
contexts' (:func:`request_status`) and the answer (:func:`messages_answer`). The wire models are
:mod:`rag_opt.wire.compress_messages_protocol`; ``rag-opt serve``'s route (:mod:`rag_opt.server.compress_messages`)
runs the jobs on its engine, counts them and answers.

The answer holds as many messages as were sent, in the same order, each the same JSON value as sent except for the
optimized texts; the token counts are the contexts', in the target tokenizer (0 when nothing was optimized), and
``compression_ratio`` is ``tokens_after / tokens_before`` (1.0 when nothing was optimized).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from rag_opt.wire.compress_messages_protocol import (
    MESSAGES_FIELD,
    ContextStats,
    MessagesConfig,
    MessagesRequest,
    MessagesStats,
    Status,
)
from rag_opt.wire.conversation import Turn
from rag_opt.wire.errors import RequestError
from rag_opt.wire.job import Attempt, Job
from rag_opt.wire.request import Options, check_messages, check_readable
from rag_opt.wire.settings import WireSettings

__all__ = [
    "MAX_IGNORED",
    "MAX_NAME",
    "MessagesContext",
    "context_jobs",
    "ignored_fields",
    "messages_answer",
    "read_messages",
    "request_status",
]

_DOCUMENTS_FIELDS = ("question", "query", "documents")  # the documents contract's: not mixed with this one
_READ = frozenset({MESSAGES_FIELD, "model", "config"})
MAX_IGNORED = 20  # names listed in stats.ignored (each cut to MAX_NAME characters)
MAX_NAME = 64


def _invalid(exc: ValidationError) -> RequestError:
    """The 400 for the first problem pydantic found, named by its place (``config.ratio``)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or None
    msg = "missing (required)" if err["type"] == "missing" else err["msg"].removeprefix("Value error, ")
    return RequestError(f"{where}: {msg}" if where else msg, where, "invalid_value")


def ignored_fields(data: Mapping[str, Any]) -> list[str]:
    """The fields of ``data`` rag-opt does not read (a gateway's own settings, session ids, ...), listed in
    ``stats.ignored`` (at most :data:`MAX_IGNORED`, each cut to :data:`MAX_NAME` characters)."""
    names = [k for k in data if k not in _READ]
    config = data.get("config")
    if isinstance(config, dict):
        names += [f"config.{k}" for k in config if k not in MessagesConfig.model_fields]
    return [n[:MAX_NAME] for n in names[:MAX_IGNORED]]


def read_messages(data: dict[str, Any]) -> MessagesRequest:
    """The request in ``data`` (a parsed body with ``messages``), checked; raises RequestError."""
    mixed = [k for k in _DOCUMENTS_FIELDS if k in data]
    if mixed:
        raise RequestError(
            f"{mixed[0]}: a body has either messages (the messages contract) or question and documents (the "
            "documents contract), not both",
            mixed[0],
            "invalid_request",
        )
    check_readable(data)  # rag-opt reads the whole body: a duplicate key or a lone surrogate anywhere is a 400
    check_messages(data[MESSAGES_FIELD])
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


@dataclass
class MessagesContext:
    """One turn with context and a question, and what became of it."""

    turn: Turn
    job: Job
    attempt: Attempt | None = None
    written: dict[int, Any] | None = None  # the changed messages (None: not optimized)
    reason: str | None = None

    def stats(self) -> ContextStats:
        result = self.attempt.result if self.attempt is not None and self.written is not None else None
        out = ContextStats(
            messages=self.turn.context_messages,
            question_from=self.turn.question_from,
            documents=len(self.job.documents),
            status="fail_open",
            reason=self.reason,
        )
        if result is None:
            return out
        lexical = result.tier == "lexical"
        out.status = "unchanged" if result.tier == "none" else "optimized_lexical" if lexical else "optimized"
        out.tier = result.tier if result.tier in ("model", "lexical") else "none"
        out.tokens_before, out.tokens_after, out.timings = result.tokens_before, result.tokens_after, result.timings
        return out


def context_jobs(
    ready: list[Turn],
    documents: list[list[dict[str, Any]]],
    options: Options | None,
    config: MessagesConfig,
    settings: WireSettings,
    namespace: str | None = None,
) -> list[MessagesContext]:
    """A context for each turn of ``ready`` (its documents in ``documents``): ``config``'s budget, ordering and
    language over the request's ``x-ragopt-*`` ``options`` over the settings'; ``namespace``: its encoding cache
    tenant."""
    budget = config.budget() or (options.budget if options is not None else None) or settings.budget
    ordering = config.ordering or (options.ordering if options is not None else None) or settings.ordering
    language = config.language or (options.language if options is not None else None)
    return [
        MessagesContext(
            t, Job(t.plan.query or "", docs, budget, ordering, language, config.target, config.tier, namespace)
        )
        for t, docs in zip(ready, documents, strict=True)
    ]


def messages_answer(
    req: MessagesRequest,
    contexts: list[MessagesContext],
    status: Status,
    reason: str | None,
    t0: float,
    config: MessagesConfig,
    ignored: list[str],
    language: str | None,
    settings: WireSettings,
) -> dict[str, Any]:
    """The answer: the messages with the contexts written back, the token counts and the stats (``language``: the
    one used, ``t0``: when the request began)."""
    messages = list(req.messages)
    changed: list[int] = []
    before = after = 0
    stats: list[ContextStats] = []
    warnings: list[str] = []
    tiers: set[str] = set()
    hits: list[tuple[int | None, int | None]] = []
    encoding: Literal["parallel", "joint"] | None = None
    target: str | None = config.target
    for c in contexts:
        stats.append(c.stats())
        result = c.attempt.result if c.attempt is not None else None
        if c.written is None or result is None:
            continue
        for i, message in c.written.items():
            messages[i] = message
            changed.append(i)
        before, after = before + result.tokens_before, after + result.tokens_after
        warnings += result.warnings
        target = target or result.target_tokenizer
        if result.tier in ("model", "lexical"):
            tiers.add(result.tier)
        if result.tier == "model" and result.encoding is not None:
            encoding = encoding or result.encoding
            if settings.expose_cache_hits and result.encoding == "parallel":
                hits.append((result.cache_hits, result.cache_misses))
    tier: Literal["model", "lexical", "mixed", "none"] = (
        "mixed" if len(tiers) > 1 else "model" if "model" in tiers else "lexical" if tiers else "none"
    )
    counted = [h for h in hits if h[0] is not None and h[1] is not None]
    answer = MessagesStats(
        status=status,
        reason=reason,
        tier=tier,
        messages_changed=sorted(changed),
        contexts=stats,
        target_tokenizer=target,
        ordering=contexts[0].job.ordering if contexts else config.ordering or settings.ordering,
        language=language,
        encoding=encoding,
        cache_hits=sum(h[0] or 0 for h in counted) if counted else None,
        cache_misses=sum(h[1] or 0 for h in counted) if counted else None,
        total_ms=(time.perf_counter() - t0) * 1e3,
        warnings=warnings,
        ignored=ignored,
    )
    return {
        "messages": messages,
        "tokens_before": before,
        "tokens_after": after,
        "tokens_saved": before - after,
        "compression_ratio": after / before if before else 1.0,
        "stats": answer.model_dump(mode="json"),
    }


def request_status(contexts: list[MessagesContext]) -> tuple[Status, str | None]:
    """The request's status from its contexts': optimized when any was, else what the rest came to."""
    done = [c.stats() for c in contexts]
    failed = [d for d in done if d.status == "fail_open"]
    kinds = {d.status for d in done} - {"fail_open"}
    if not kinds:
        return "fail_open", failed[0].reason
    status: Status = (
        "optimized" if "optimized" in kinds else "optimized_lexical" if "optimized_lexical" in kinds else "unchanged"
    )
    if failed:
        return status, f"{len(failed)} of {len(done)} contexts not optimized: {failed[0].reason}"
    lexical = [d.reason for d in done if d.status == "optimized_lexical" and d.reason]
    return status, lexical[0] if lexical else None
