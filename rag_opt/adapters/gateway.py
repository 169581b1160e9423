"""The gateway side of an LLM request: its context optimized before the gateway sends it upstream, for adapters
that receive the whole request body as a dict (:mod:`rag_opt.adapters.litellm`).

:class:`RequestOptimizer` rewrites a request with the transport-free core that ``rag-opt serve`` runs too
(:class:`rag_opt.wire.flow.RequestFlow`, with the planners of :mod:`rag_opt.wire`: chat completions,
:func:`rag_opt.wire.chat.plan_chat`; Anthropic messages, :func:`rag_opt.wire.anthropic_messages.plan_messages`),
so it follows the proxy's conventions (``<document>`` blocks, large tool results of the current turn, the
``rag_opt`` extension field and the ``x-ragopt-*`` headers, a request's options over the gateway's). Its settings
are :attr:`GatewaySettings.wire`; its backend optimizes in-process (a :class:`rag_opt.ContextOptimizer` built
once, run on a worker thread within the timeout and the default work limits of ``rag-opt serve``,
:data:`rag_opt.work.DEFAULT_LIMITS`) or on a sidecar (``rag-opt serve``'s ``POST /v1/compress``), and the core
writes the result back with the planner. It returns the new message part of the body (without the ``rag_opt``
field) and what happened as the core's :class:`~rag_opt.wire.flow.Outcome`. Nothing is scored, selected or ordered
here.

Failures follow :attr:`GatewaySettings.fail_closed`: by default (fail-open) an optimizer or sidecar that fails
(an error, the timeout, the work limits, a sidecar that cannot be reached, answers an error or fails open itself)
leaves the request unoptimized, with a warning, and so does a failure to find the context, to write the result
back (``fail_open``, reason ``error: <exception type>``) or to rewrite the request unoptimized (its messages go on
as sent), as on ``rag-opt serve``; fail-closed raises :class:`GatewayError` (503). An invalid ``rag_opt`` field or
``x-ragopt-*`` header is always a :class:`GatewayError` (400), as on the proxy.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from rag_opt.errors import ConfigurationError, InvalidInputError, RagOptError, WorkLimitExceeded
from rag_opt.types import DEFAULT_ORDERING, DEFAULT_RATIO, Budget
from rag_opt.wire.anthropic_messages import plan_messages
from rag_opt.wire.chat import plan_chat
from rag_opt.wire.documents import ContextPlan
from rag_opt.wire.errors import RequestError
from rag_opt.wire.flow import Outcome, Planner, RequestFlow
from rag_opt.wire.job import Attempt, Job
from rag_opt.wire.settings import WireSettings

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

__all__ = ["API", "EXTENSION_FIELD", "GatewayError", "GatewaySettings", "RequestOptimizer"]

logger = logging.getLogger(__name__)

API = Literal["chat", "anthropic"]
EXTENSION_FIELD = "rag_opt"  # the request's own rag-opt field: never sent upstream
OWNED: dict[str, tuple[str, ...]] = {"chat": ("messages",), "anthropic": ("messages", "system")}  # planner-written
_PLANNERS: dict[str, Planner] = {"chat": plan_chat, "anthropic": plan_messages}
_WARMUP = ("What does the guardrail load at start-up?", ["It loads its model at start-up. Then requests are fast."])


class GatewayError(RagOptError, RuntimeError):
    """A request refused: an invalid ``rag_opt`` field or ``x-ragopt-*`` header (4xx), or an optimization that
    failed under ``fail_closed`` (503). ``status_code``, ``message``, ``type``, ``param`` and ``code`` are the
    fields of an OpenAI-style error (LiteLLM builds its answer from them)."""

    def __init__(self, message: str, status_code: int, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.param = param
        self.type = "invalid_request_error" if status_code < 500 else "service_unavailable"


class GatewaySettings(BaseModel):
    """Where and how the context is optimized; a request's ``rag_opt`` field and headers override the budget,
    ordering and language."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["in_process", "sidecar"] = Field(
        default="in_process", description="in_process: a ContextOptimizer in this process; sidecar: rag-opt serve"
    )
    sidecar_url: str | None = Field(default=None, description="rag-opt serve's base URL, e.g. http://127.0.0.1:8000")
    sidecar_api_key: SecretStr | None = Field(default=None, description="its --api-key; os.environ/NAME reads NAME")
    ratio: float | None = Field(default=None, description="fraction of context tokens to keep (default 0.5)")
    target_tokens: int | None = Field(default=None, description="context tokens to keep")
    threshold: float | None = Field(default=None, description="keep units at least this likely relevant")
    ordering: str = Field(default=DEFAULT_ORDERING, description="document ordering")
    target: str | None = Field(default=None, description="tokenizer of the upstream LLM: budgets count in it")
    language: str | None = Field(default=None, description="ISO 639 code of the documents' language")
    tier: Literal["auto", "model", "lexical"] = Field(default="auto", description="the scoring tier")
    fail_closed: bool = Field(default=False, description="refuse the request when the optimization fails")
    timeout: float = Field(default=30.0, gt=0, description="seconds for one optimization (one sidecar call)")
    document_tag: str = Field(default="document", description="context documents are <TAG ...>...</TAG> blocks")
    tool_messages: bool = Field(default=True, description="optimize large tool results of the current turn")
    tool_min_chars: int = Field(default=2000, ge=1, description="a tool result is context from this many chars")
    max_concurrency: int = Field(default=1, ge=1, description="in-process optimizations running at once")
    warmup: bool = Field(default=True, description="in-process: load the proxy model at start, in the background")
    optimizer: dict[str, Any] = Field(
        default_factory=dict, description="in-process optimizer options (rag_opt.OptimizerOptions, by name)"
    )

    @field_validator("sidecar_api_key", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if isinstance(v, str) and v.startswith("os.environ/"):
            name = v.removeprefix("os.environ/")
            if not os.environ.get(name):
                raise ValueError(f"the environment variable {name} is not set")
            return os.environ[name]
        return v

    @field_validator("optimizer")
    @classmethod
    def _optimizer_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        from rag_opt.option_args import check_option_names

        check_option_names(v, "optimizer")  # an unknown name, with the closest option
        return v

    @model_validator(mode="after")
    def _consistent(self) -> GatewaySettings:
        from rag_opt.text.language import check_language
        from rag_opt.types import Budget, check_ordering

        try:
            Budget(ratio=self.ratio, target_tokens=self.target_tokens, threshold=self.threshold)
            check_ordering(self.ordering)
            if self.language is not None:
                check_language(self.language)
        except InvalidInputError as exc:
            raise ValueError(str(exc)) from None
        if self.backend == "sidecar" and not self.sidecar_url:
            raise ValueError("backend: sidecar needs sidecar_url (rag-opt serve's URL, e.g. http://127.0.0.1:8000)")
        if self.backend == "sidecar" and self.optimizer:
            names = ", ".join(sorted(self.optimizer))
            raise ValueError(f"{names}: in-process options; with backend: sidecar, rag-opt serve's flags set them")
        if self.backend == "in_process" and self.sidecar_url:
            raise ValueError("sidecar_url is for backend: sidecar (set backend: sidecar, or remove it)")
        return self

    @cached_property
    def wire(self) -> WireSettings:
        """What the transport-free core reads of these settings (:mod:`rag_opt.wire`): where context is found, and
        a request's defaults (the budget, 0.5 of the context when none is set; ordering, language, target, tier).
        An outcome reports the cache hits and misses of an in-process optimization."""
        budget = Budget(ratio=self.ratio, target_tokens=self.target_tokens, threshold=self.threshold)
        return WireSettings(
            document_tag=self.document_tag,
            tool_messages=self.tool_messages,
            tool_min_chars=self.tool_min_chars,
            budget=budget if budget.compresses else Budget(ratio=DEFAULT_RATIO),
            ordering=self.ordering,
            language=self.language,
            target=self.target,
            tier=self.tier,
            expose_cache_hits=True,
        )


class RequestOptimizer:
    """Optimizes the context of request bodies (see the module docstring); one per gateway configuration."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = s = settings
        self._flows = {api: RequestFlow(planner, s.wire) for api, planner in _PLANNERS.items()}
        self._backend = _Backend(self)
        self._optimizer: Any = None
        self._ready = threading.Event()
        self._limiter: Any = None
        self._client: Any = None
        if s.backend == "in_process":
            from rag_opt.pipeline import ContextOptimizer

            options = {k: v for k, v in (("language", s.language), ("target", s.target)) if v is not None}
            try:  # (cheap: the proxy model loads on first use)
                self._optimizer = ContextOptimizer(**{**options, **s.optimizer})
            except (TypeError, ValueError) as exc:
                raise ConfigurationError(f"the in-process optimizer's options: {exc}") from None
            if s.warmup:
                threading.Thread(target=self._warm, name="rag-opt-warmup", daemon=True).start()
                return
        self._ready.set()

    def _warm(self) -> None:
        """Load the proxy model (one small optimization); requests wait for it, within their timeout."""
        try:
            self._optimizer.optimize(_WARMUP[0], _WARMUP[1], ratio=0.5)
        except Exception as exc:  # requests try again, and fail open or closed
            logger.warning("rag-opt: loading the proxy model failed (%s: %s)", type(exc).__name__, exc)
        finally:
            self._ready.set()

    async def rewrite(
        self, api: API, data: Mapping[str, Any], headers: Mapping[str, str]
    ) -> tuple[Outcome, dict[str, Any] | None]:
        """The outcome for the request ``data`` (its ``x-ragopt-*`` ``headers``) and the new values of its
        planner-written members (:data:`OWNED`; None: unchanged). Raises :class:`GatewayError` for an invalid
        request, or a failed optimization under ``fail_closed``."""
        try:
            raw = json.dumps({k: data[k] for k in (*OWNED[api], EXTENSION_FIELD) if k in data}).encode()
        except Exception as exc:  # a body rag-opt cannot read is not the client's fault: not a 400
            return Outcome("fail_open", reason=self._backend.unreadable(exc)), None
        try:
            rewritten = await self._flows[api].apply(raw, headers, self._backend)
        except RequestError as exc:
            raise GatewayError(f"rag-opt: {exc.message}", exc.status, exc.code, exc.param) from None
        outcome, result = rewritten.outcome, rewritten.outcome.result
        outcome.result = None  # (a server's span reads it; the guardrail logs the outcome as a dict)
        if result is not None:
            logger.info(
                "rag-opt: %s, %d -> %d context tokens", outcome.status, result.tokens_before, result.tokens_after
            )
        return outcome, None if rewritten.body is raw else dict(json.loads(rewritten.body))

    def _refuse_if_closed(self, reason: str) -> None:
        if self.settings.fail_closed:
            message = f"rag-opt could not optimize the context ({reason}) and is configured fail-closed"
            raise GatewayError(message, 503, "ragopt_unavailable") from None

    async def _in_process(self, job: Job) -> tuple[OptimizeResult, str]:
        """Optimize on a worker thread within the timeout (and the work limits ``rag-opt serve`` defaults to)."""
        import anyio
        import anyio.to_thread

        from rag_opt.work import DEFAULT_LIMITS, scope

        limits = DEFAULT_LIMITS  # rag-opt serve's defaults (--max-units, --max-proxy-tokens, --max-question-tokens)
        cancel = threading.Event()
        optimizer, settings = self._optimizer, job.settings()
        if job.tier == "lexical":
            settings["tier"] = "lexical"

        def work() -> OptimizeResult:
            self._ready.wait()  # the proxy model loading at start-up
            with scope(limits=limits, cancel=cancel, progress=False):
                result: OptimizeResult = optimizer.optimize(job.query, job.documents, **settings)
                return result

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.settings.max_concurrency)
        try:
            with anyio.fail_after(self.settings.timeout):
                result = await anyio.to_thread.run_sync(work, limiter=self._limiter, abandon_on_cancel=True)
        finally:
            cancel.set()  # a run left behind by the timeout stops at its next checkpoint
        return result, "optimized_lexical" if result.tier == "lexical" else "optimized"

    async def _sidecar(self, job: Job) -> tuple[OptimizeResult, str]:
        """One call of the sidecar's ``POST /v1/compress``; raises ``_SidecarFailed`` when it gives no result."""
        import httpx

        from rag_opt.types import OptimizeResult, OutputDocument

        s = self.settings
        docs = [{k: d[k] for k in ("text", "title") if d.get(k) is not None} for d in job.documents]
        body: dict[str, Any] = {"question": job.query, "documents": docs, "ordering": job.ordering, "tier": job.tier}
        body.update({k: v for k, v in (("language", job.language), ("target", job.target)) if v is not None})
        body.update(job.budget.as_kwargs())
        key = s.sidecar_api_key
        headers = {"authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=str(s.sidecar_url).rstrip("/"), timeout=s.timeout)
        try:
            response = await self._client.post("/v1/compress", json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise _SidecarFailed(f"sidecar unreachable: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise _SidecarFailed(f"sidecar answered HTTP {response.status_code}")
        data = response.json()
        if data["status"] == "fail_open":
            raise _SidecarFailed(f"sidecar failed open: {data.get('reason')}")
        fields = ("id", "index", "text", "title", "kept_spans")
        kept = [OutputDocument(**{k: d[k] for k in fields}) for d in data["documents"]]
        dropped = sorted(set(range(len(docs))) - {d.index for d in kept})
        for i in [i for i in dropped if job.documents[i].get("required")]:  # the proxy's contract: never emptied
            kept.append(OutputDocument(id=str(i), index=i, text=job.documents[i]["text"]))
            dropped.remove(i)
        result = OptimizeResult(
            query=job.query,
            documents=kept,
            dropped=[OutputDocument(id=str(i), index=i, text="") for i in dropped],
            tokens_before=data["tokens_before"],
            tokens_after=data["tokens_after"],
            target_tokenizer=data.get("target_tokenizer") or "",
            scorer="sidecar",
        )
        return result, str(data["status"])

    async def aclose(self) -> None:
        """Close the sidecar client."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class _SidecarFailed(RagOptError, RuntimeError):
    """The sidecar gave no result (unreachable, an error answer, or it failed open itself)."""


class _Backend:
    """A gateway's optimizer (in-process or a sidecar) as the core's backend (:class:`rag_opt.wire.flow.Backend`):
    a failure fails open with a warning, or raises :class:`GatewayError` under ``fail_closed``."""

    def __init__(self, gateway: RequestOptimizer) -> None:
        self.gateway = gateway

    async def run(self, job: Job) -> Attempt:
        gateway, t0 = self.gateway, time.perf_counter()
        try:
            sidecar = gateway.settings.backend == "sidecar"
            result, status = await (gateway._sidecar(job) if sidecar else gateway._in_process(job))
        except Exception as exc:
            gateway._refuse_if_closed(reason := _reason(exc))
            logger.warning("rag-opt: optimization failed (%s); forwarding the request unoptimized", reason)
            return Attempt(None, t0, reason)
        return Attempt(result, t0, status=status)

    def record(self, attempt: Attempt, plan: ContextPlan) -> float:
        return attempt.elapsed_ms()

    def unreadable(self, exc: Exception) -> str:
        return self._failed(exc, "finding the context failed", "not optimizing")

    def unwritable(self, exc: Exception, attempt: Attempt) -> Attempt:
        reason = self._failed(exc, "writing the optimized context back failed", "forwarding the request unoptimized")
        return Attempt(None, attempt.t0, reason)

    def unrendered(self, exc: Exception) -> None:
        self._failed(exc, "rewriting the request failed", "forwarding its messages as sent")

    def _failed(self, exc: Exception, what: str, then: str) -> str:
        """A failure of the core's own steps: refused under ``fail_closed``, else a warning naming the exception's
        type (never the request's content); the fail-open reason."""
        self.gateway._refuse_if_closed(reason := f"error: {type(exc).__name__}")
        logger.warning("rag-opt: %s (%s); %s", what, reason, then)
        return reason


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, WorkLimitExceeded):
        return "limit"
    return str(exc) if isinstance(exc, _SidecarFailed) else f"error: {type(exc).__name__}"
