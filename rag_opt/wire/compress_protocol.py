"""The documents contract of ``POST /v1/compress`` on the wire: its request and response models, read and written
by :mod:`rag_opt.wire.compress` (``rag-opt serve`` serves them: :mod:`rag_opt.server.compress`) and published as
``docs/compress.schema.json``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rag_opt.explanation import Explanation
from rag_opt.options import BUDGET_FIELDS  # also accepted at the top level of a request
from rag_opt.types import MAX_EXPLAINED_UNITS, Budget, Timings
from rag_opt.wire.compress_fields import LanguageCode, OrderingChoice, Ratio, TargetTokens, Threshold
from rag_opt.wire.job import TierChoice

__all__ = [
    "COMPRESS_PATH",
    "SCHEMA_PATH",
    "CompressBudget",
    "CompressDocument",
    "CompressRequest",
    "CompressResponse",
    "CompressTimings",
    "OutputDocument",
]

COMPRESS_PATH = "/v1/compress"
SCHEMA_PATH = "/v1/compress/schema"
_STRICT = ConfigDict(extra="forbid", strict=True)  # strict: JSON types are not coerced ("0.5", true)


class CompressDocument(BaseModel):
    """One retrieved document (a plain string is the same as ``{"text": ...}``)."""

    model_config = _STRICT

    text: str = Field(description="the document's text (not empty)")
    id: str | None = Field(default=None, description="your id for it (default: its index in the list, as a string)")
    title: str | None = Field(default=None, description="its title: helps scoring, not part of the text")
    metadata: dict[str, Any] = Field(default_factory=dict, description="returned unchanged")


class CompressBudget(BaseModel):
    """How much to keep: at most one of ``ratio``, ``target_tokens`` and ``threshold`` (rag_opt.Budget)."""

    model_config = _STRICT

    ratio: Ratio = None
    target_tokens: TargetTokens = None
    threshold: Threshold = None

    @model_validator(mode="after")
    def _one(self) -> CompressBudget:
        if self.ratio is None and self.target_tokens is None and self.threshold is None:
            raise ValueError("give one of ratio, target_tokens and threshold (leave budget out for the server's)")
        self.budget()  # at most one limit
        return self

    def budget(self) -> Budget:
        return Budget(ratio=self.ratio, target_tokens=self.target_tokens, threshold=self.threshold)


class CompressRequest(BaseModel):
    """The body of ``POST /v1/compress``."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"title": "rag-opt compress request"})

    question: str = Field(
        min_length=1, description="the question the documents should answer (alias: query, the Python API's name)"
    )
    documents: list[str | CompressDocument] = Field(min_length=1, description="the retrieved documents, in order")
    budget: CompressBudget | None = Field(
        default=None,
        description="default: the server's budget (--ratio, ...; 0.5 unless set). Its fields may also be given at "
        "the top level (ratio, target_tokens, threshold), as in the Python API",
    )
    ordering: OrderingChoice | None = Field(default=None, description="document ordering (default: the server's)")
    target: str | None = Field(
        default=None,
        description="the LLM the context is for: budgets and token counts are in its tokenizer (an OpenAI model or "
        "tiktoken encoding name, or hf:<tokenizer>; default: the server's --target). Only a tokenizer the server "
        "allows (its --allowed-targets; default: o200k_base, cl100k_base, the model names of those encodings, and "
        "its --target): any other is a 400",
    )
    language: LanguageCode | None = Field(
        default=None,
        description="ISO 639 code of the documents' language (en, de, pt-BR, ...): segmentation and BM25 "
        "stopwords follow it (default: the server's --language)",
    )
    tier: TierChoice = Field(
        default="auto",
        description="auto: the proxy model, the lexical tier when it cannot take the request (saturated, loading, "
        "over its time budget); model: the proxy model only; lexical: the lexical tier only (no model, milliseconds)",
    )
    explain: bool = Field(
        default=False,
        description="add explanation: every document's units (character span, kept, score, rank) and why each "
        f"was kept or dropped, at most {MAX_EXPLAINED_UNITS} units listed (docs/sidecar.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        """The Python API's spellings are accepted too (one vocabulary): ``query`` for ``question``, and the
        budget's fields at the top level (``ratio``, ``target_tokens``, ``threshold``) for ``budget``. Both
        spellings at once is a 400 naming them."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "query" in data:
            if "question" in data:
                raise ValueError("give the question once: as question or as query (its alias), not both")
            data["question"] = data.pop("query")
        flat = {k: data.pop(k) for k in BUDGET_FIELDS if k in data}
        if flat:
            if "budget" in data:
                raise ValueError(
                    f"give the budget once: as budget={{...}} or as {', '.join(flat)} at the top level, not both"
                )
            data["budget"] = flat
        return data

    @field_validator("question")
    @classmethod
    def _question(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("the question is blank")
        return v

    def as_documents(self) -> list[dict[str, Any]]:
        """The documents as the optimizer takes them."""
        return [{"text": d} if isinstance(d, str) else d.model_dump(exclude_none=True) for d in self.documents]


class OutputDocument(BaseModel):
    """One document as it goes to the LLM."""

    id: str = Field(description="the input id, or the input index as a string")
    index: int = Field(description="its position in the request's documents")
    text: str = Field(description="the kept text: its kept spans of the input text, verbatim, joined")
    title: str | None = Field(default=None, description="the title rag-opt read (see title_source)")
    title_source: str | None = Field(
        default=None,
        description="where the title was found: field, metadata.<key> (the server's --title-keys), or text (the "
        "text's leading heading line, which stays in text)",
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="the input metadata, unchanged")
    score: float | None = Field(default=None, description="document relevance (when scoring ran)")
    kept_spans: list[tuple[int, int]] = Field(
        description="[start, end) character offsets into the input text of the kept pieces, in order"
    )
    tokens_before: int | None = None
    tokens_after: int | None = None


class CompressTimings(BaseModel):
    """Milliseconds."""

    total_ms: float = Field(description="from the start of the optimization to the answer, queueing included")
    optimizer: Timings | None = Field(default=None, description="the optimizer's stages (none on fail-open)")


class CompressResponse(BaseModel):
    """The answer of ``POST /v1/compress``."""

    model_config = ConfigDict(json_schema_extra={"title": "rag-opt compress response"})

    status: Literal["optimized", "optimized_lexical", "unchanged", "fail_open"] = Field(
        description="optimized (proxy model), optimized_lexical (lexical tier), unchanged (no compression asked "
        "for) or fail_open (the documents as sent: see reason)"
    )
    reason: str | None = Field(
        default=None, description="why it failed open, or why the lexical tier ran instead of the model"
    )
    tier: Literal["model", "lexical", "none"] = Field(description="the tier that scored (none: nothing scored)")
    documents: list[OutputDocument] = Field(description="the kept documents, in output order")
    dropped: list[str] = Field(default_factory=list, description="ids of the documents with nothing kept")
    tokens_before: int | None = Field(description="context tokens sent (target tokenizer; null on fail-open)")
    tokens_after: int | None = Field(description="context tokens kept (target tokenizer; null on fail-open)")
    token_budget: int | None = None
    target_tokenizer: str | None = None
    ordering: str
    placement_profile: str | None = Field(
        default=None,
        description="ordering 'calibrated': the profile that placed the documents (the reader's, else the proxy's; "
        "null: end placement, or another ordering)",
    )
    language: str
    timings: CompressTimings
    warnings: list[str] = Field(default_factory=list)
    encoding: Literal["parallel", "joint"] | None = Field(
        default=None, description="how the proxy model read the context (null: the proxy model did not read it)"
    )
    cache_hits: int | None = Field(
        default=None,
        description="parallel encoding: document blocks whose encoding came from the encoding cache (null otherwise, "
        "and unless the server runs with --expose-cache-hits)",
    )
    cache_misses: int | None = Field(
        default=None,
        description="parallel encoding: document blocks this request encoded (null otherwise, and unless the server "
        "runs with --expose-cache-hits)",
    )
    explanation: Explanation | None = Field(
        default=None,
        description="with explain: true, each document (input order) with its units and why each was kept or "
        "dropped (null otherwise, and on fail-open)",
    )
