"""Headroom's messages contract of ``POST /v1/compress`` on the wire: its request, ``config`` and response models,
read and written by :mod:`rag_opt.wire.compress_messages` (``rag-opt serve`` serves them:
:mod:`rag_opt.server.compress_messages`) and published in ``docs/compress.schema.json``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rag_opt.types import Budget, Timings
from rag_opt.wire.compress_fields import LanguageCode, OrderingChoice, Ratio, TargetTokens, Threshold
from rag_opt.wire.conversation import QuestionSource
from rag_opt.wire.job import TierChoice

__all__ = [
    "MESSAGES_FIELD",
    "ContextStats",
    "MessagesConfig",
    "MessagesRequest",
    "MessagesResponse",
    "MessagesStats",
    "is_messages_body",
    "messages_schemas",
]

MESSAGES_FIELD = "messages"
Status = Literal["optimized", "optimized_lexical", "unchanged", "no_context", "no_query", "disabled", "fail_open"]
ContextStatus = Literal["optimized", "optimized_lexical", "unchanged", "fail_open"]


class MessagesConfig(BaseModel):
    """rag-opt's options in the request's ``config``; other keys (a gateway's settings for Headroom) are
    ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    ratio: Ratio = None
    target_tokens: TargetTokens = None
    threshold: Threshold = None
    ordering: OrderingChoice | None = Field(default=None, description="document ordering (default: the server's)")
    language: LanguageCode | None = Field(default=None, description="ISO 639 code of the context's language")
    target: str | None = Field(
        default=None,
        description="the tokenizer budgets and token counts are in: one the server allows (--allowed-targets), "
        "else a 400 (default: the server's --target)",
    )
    tier: TierChoice = Field(default="auto", description="auto, model or lexical, as in the documents contract")

    @model_validator(mode="after")
    def _one_budget(self) -> MessagesConfig:
        self.budget()  # at most one limit
        return self

    def budget(self) -> Budget | None:
        """The budget given here (None: none)."""
        if self.ratio is None and self.target_tokens is None and self.threshold is None:
            return None
        return Budget(ratio=self.ratio, target_tokens=self.target_tokens, threshold=self.threshold)


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/compress`` in Headroom's contract (told apart by ``messages``)."""

    model_config = ConfigDict(
        extra="allow", strict=True, json_schema_extra={"title": "rag-opt compress request (messages)"}
    )

    messages: list[dict[str, Any]] = Field(
        description="the conversation: OpenAI chat messages (string content or text parts, tool messages) or "
        "Anthropic messages (text, tool_result and document blocks)"
    )
    model: str | None = Field(default=None, description="the LLM the messages are for (the per-model totals)")
    config: MessagesConfig | None = Field(default=None, description="rag-opt's options; other keys are ignored")


class ContextStats(BaseModel):
    """One context found in the messages and what was done with it."""

    messages: list[int] = Field(description="positions of the messages holding it")
    question_from: QuestionSource | None = Field(
        description="user: the latest user message before it; tool_call: the arguments of the tool call it answers"
    )
    documents: int = Field(description="documents found in it")
    status: ContextStatus
    reason: str | None = None
    tier: Literal["model", "lexical", "none"] = "none"
    tokens_before: int | None = None
    tokens_after: int | None = None
    timings: Timings | None = Field(default=None, description="the optimizer's stages (milliseconds)")


class MessagesStats(BaseModel):
    """What rag-opt did with the messages."""

    engine: Literal["rag-opt"] = "rag-opt"
    status: Status = Field(
        description="optimized / optimized_lexical (by the proxy model / the lexical tier), unchanged (no "
        "compression asked for), no_context, no_query, disabled or fail_open: the last four return the messages "
        "as sent"
    )
    reason: str | None = Field(default=None, description="why nothing (or not everything) was optimized")
    tier: Literal["model", "lexical", "mixed", "none"] = "none"
    messages_changed: list[int] = Field(default_factory=list, description="positions of the messages changed")
    contexts: list[ContextStats] = Field(default_factory=list, description="each context with a question")
    target_tokenizer: str | None = None
    ordering: str | None = None
    language: str | None = None
    encoding: Literal["parallel", "joint"] | None = Field(
        default=None, description="how the proxy model read the context (null: it did not read it)"
    )
    cache_hits: int | None = Field(default=None, description="as in the documents contract (--expose-cache-hits)")
    cache_misses: int | None = None
    total_ms: float = Field(description="milliseconds from reading the request to the answer")
    warnings: list[str] = Field(default_factory=list)
    ignored: list[str] = Field(default_factory=list, description="fields and config keys rag-opt does not read")


class MessagesResponse(BaseModel):
    """The answer of ``POST /v1/compress`` in Headroom's contract."""

    model_config = ConfigDict(json_schema_extra={"title": "rag-opt compress response (messages)"})

    messages: list[dict[str, Any]] = Field(description="as many as were sent, in order; only optimized texts change")
    tokens_before: int = Field(description="context tokens before (target tokenizer; 0: nothing optimized)")
    tokens_after: int = Field(description="context tokens after")
    tokens_saved: int
    compression_ratio: float = Field(description="tokens_after / tokens_before (1.0: nothing optimized)")
    stats: MessagesStats


def is_messages_body(data: Mapping[str, Any]) -> bool:
    """Whether a ``/v1/compress`` body is in this contract (it has ``messages``)."""
    return MESSAGES_FIELD in data


def messages_schemas() -> dict[str, Any]:
    """The JSON schemas of this contract's request and response (part of ``docs/compress.schema.json``)."""
    return {
        "messages_request": MessagesRequest.model_json_schema(),
        "messages_response": MessagesResponse.model_json_schema(),
    }
