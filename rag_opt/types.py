"""The public value types: input documents, the budget, ordering names, scored units and the result."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rag_opt.errors import InvalidInputError, InvalidInputTypeError

__all__ = [
    "DEFAULT_ORDERING",
    "DEFAULT_RATIO",
    "MAX_EXPLAINED_UNITS",
    "ORDERING_NAMES",
    "Budget",
    "Document",
    "DocumentLike",
    "OptimizeResult",
    "OrderingName",
    "OutputDocument",
    "TIERS",
    "Tier",
    "Timings",
    "UNIT_REASONS",
    "Unit",
    "UnitKind",
    "UnitReason",
    "check_ordering",
    "to_documents",
]

UnitKind = Literal["title", "sentence", "heading", "list_item", "code", "table", "json"]

UnitReason = Literal[
    # kept
    "selected",
    "fill",
    "required",
    "floor",
    "first",
    "best_of_document",
    "antecedent",
    "title",
    "heading",
    "structure",
    "no_compression",
    # dropped
    "budget",
    "recount",
    "below_threshold",
    "document_below_best",
    "unused",
]
"""Why the select stage kept or dropped a unit (:attr:`Unit.reason`), decided where the decision is made
(:func:`rag_opt.compressors.selection.select`); :data:`rag_opt.explanation.REASONS` says each in words."""
UNIT_REASONS: tuple[str, ...] = get_args(UnitReason)
MAX_EXPLAINED_UNITS = 2000
"""The most units one explanation lists (:func:`rag_opt.explanation.explain_result`, ``explain: true`` on
``/v1/compress``): documents in input order, each with its units, until this many are listed; the rest are counted,
not listed."""

OrderingName = Literal[
    "input", "lost_in_the_middle", "relevance", "promote_best", "promote_clear_best", "calibrated", "attention_sort"
]
"""How kept documents are ordered: ``input`` (unchanged), ``lost_in_the_middle`` (best at both ends),
``relevance`` (best first), ``promote_best`` (the best document moves to the front, the others keep their
input order), ``promote_clear_best`` (the same, only when the first document's relevance is at most 1/20 of the
best's), ``calibrated`` (best into the slots the proxy attends to most) or ``attention_sort`` (the
proxy's attention sorts them)."""
ORDERING_NAMES: tuple[str, ...] = get_args(OrderingName)
DEFAULT_ORDERING: OrderingName = "promote_clear_best"
"""The ordering used when none is given, in the library, the CLI, the proxy, the sidecar and the gateway: of the
orderings never worse than the retriever's order at any gold slot, the one that helped the embedded reader most
(``benchmarks/litm.py``, docs/reordering.md, "The default")."""

Tier = Literal["model", "lexical"]
"""Which scorer runs: ``model`` (the proxy model's attention, or the scorer given) or ``lexical`` (the lexical
probe: BM25 and lexical features, no model, milliseconds)."""
TIERS: tuple[str, ...] = get_args(Tier)


def check_ordering(name: object) -> OrderingName:
    """``name`` as an :data:`OrderingName`, or :class:`~rag_opt.errors.InvalidInputError` naming the choices."""
    if not isinstance(name, str) or name not in ORDERING_NAMES:
        raise InvalidInputError(f"unknown ordering {name!r}; use one of {', '.join(ORDERING_NAMES)}")
    return name  # type: ignore[return-value]


DEFAULT_RATIO = 0.5
"""The one default budget of every surface (Python API, CLI, proxy, sidecar, MCP, batch): keep half of the
context's target-LLM tokens when no ``ratio``, ``target_tokens`` or ``threshold`` is given. ``ratio=1`` keeps
everything (ordering only)."""


@dataclass(frozen=True)
class Budget:
    """How much context to keep: at most one of ``ratio`` (a fraction of the input's target-LLM tokens, in
    (0, 1]), ``target_tokens`` (a token count) or ``threshold`` (keep units whose relevance probability is at
    least this). All None: no limit of its own (where a budget is optional, :data:`DEFAULT_RATIO` applies).
    Validated when built."""

    ratio: float | None = None
    target_tokens: int | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        ratio, target_tokens, threshold = self.ratio, self.target_tokens, self.threshold
        given = [
            n
            for n, v in (("ratio", ratio), ("target_tokens", target_tokens), ("threshold", threshold))
            if v is not None
        ]
        if len(given) > 1:
            raise InvalidInputError(
                f"give at most one of ratio, target_tokens and threshold (got {' and '.join(given)})"
            )
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
                raise InvalidInputError(f"ratio must be a number in (0, 1], got {ratio!r}")
            if not 0 < ratio <= 1:
                raise InvalidInputError(f"ratio must be in (0, 1], got {ratio}")
        if target_tokens is not None:
            if isinstance(target_tokens, bool) or not isinstance(target_tokens, int):
                raise InvalidInputError(f"target_tokens must be an integer, got {target_tokens!r}")
            if target_tokens < 0:
                raise InvalidInputError(f"target_tokens must be >= 0, got {target_tokens}")
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
                raise InvalidInputError(f"threshold must be a probability in [0, 1], got {threshold!r}")

    @property
    def compresses(self) -> bool:
        """Whether any limit is set."""
        return self.ratio is not None or self.target_tokens is not None or self.threshold is not None

    def tokens(self, tokens_before: int) -> int | None:
        """The token limit for a context of ``tokens_before`` target tokens (None: no token limit)."""
        if self.ratio is not None:
            return int(math.floor(self.ratio * tokens_before))
        return self.target_tokens

    def as_kwargs(self) -> dict[str, Any]:
        """``{"ratio": ..., "target_tokens": ..., "threshold": ...}``."""
        return {"ratio": self.ratio, "target_tokens": self.target_tokens, "threshold": self.threshold}


class Document(BaseModel):
    """An input document: its text, an optional id, metadata (preserved untouched) and retriever score.

    ``required``: never drop the document entirely (e.g. a tool result that is a whole message): it keeps at least
    its best unit, over the budget when even that does not fit (:attr:`OptimizeResult.over_budget`)."""

    model_config = ConfigDict(extra="forbid")

    text: str
    id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    score: float | None = None
    title: str | None = None
    required: bool = False

    @field_validator("score")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("score must be a finite number")
        return v


DocumentLike = str | Mapping[str, Any] | Document | Any  # Any: LangChain Document or similar (page_content)


def to_documents(documents: Sequence[DocumentLike]) -> list[Document]:
    """Normalise strings, dicts, :class:`Document` s and LangChain ``Document`` s to :class:`Document` s.

    Raises ``TypeError``/``ValueError`` naming the offending index for anything else.
    """
    if isinstance(documents, (str, bytes, Mapping)):
        raise InvalidInputTypeError("documents must be a list of documents, not a single " + type(documents).__name__)
    if not isinstance(documents, Iterable):
        raise InvalidInputTypeError(
            f"documents must be a list of documents (strings, dicts or Documents), got {type(documents).__name__}"
        )
    out: list[Document] = []
    for i, doc in enumerate(documents):
        try:
            out.append(_to_document(doc))
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise InvalidInputError(f"documents[{i}]: {detail}") from None
        except TypeError as exc:
            raise InvalidInputTypeError(f"documents[{i}]: {exc}") from None
        except ValueError as exc:
            raise InvalidInputError(f"documents[{i}]: {exc}") from None
    return out


def _to_document(doc: DocumentLike) -> Document:
    if isinstance(doc, Document):
        return doc
    if isinstance(doc, str):
        return Document(text=doc)
    if isinstance(doc, Mapping):
        unknown = set(doc) - {"text", "id", "metadata", "score", "title", "required", "page_content"}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}; expected text, id, metadata, score, title, required")
        text = doc.get("text", doc.get("page_content"))
        if not isinstance(text, str):
            raise TypeError(f"'text' must be a string, got {type(text).__name__}")
        doc_id = doc.get("id")
        if doc_id is not None and not isinstance(doc_id, (str, int)):
            raise TypeError(f"'id' must be a string or integer, got {type(doc_id).__name__}")
        metadata = doc.get("metadata")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, Mapping):
            raise TypeError(f"'metadata' must be an object, got {type(metadata).__name__}")
        score = doc.get("score")
        if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
            raise TypeError(f"'score' must be a number, got {type(score).__name__}")
        title = doc.get("title")
        if title is not None and not isinstance(title, str):
            raise TypeError(f"'title' must be a string, got {type(title).__name__}")
        required = doc.get("required", False)
        if not isinstance(required, bool):
            raise TypeError(f"'required' must be true or false, got {type(required).__name__}")
        return Document(
            text=text,
            id=None if doc_id is None else str(doc_id),
            metadata=dict(metadata),
            score=score,
            title=title,
            required=required,
        )
    page_content = getattr(doc, "page_content", None)
    if isinstance(page_content, str):  # LangChain Document (duck-typed: no hard import)
        metadata = dict(getattr(doc, "metadata", None) or {})
        lc_id = getattr(doc, "id", None)
        return Document(text=page_content, id=None if lc_id is None else str(lc_id), metadata=metadata)
    raise TypeError(
        f"unsupported document type {type(doc).__name__}: use a string, a dict with 'text', "
        "a rag_opt.Document or a LangChain Document"
    )


class Unit(BaseModel):
    """A unit of a document: a sentence (or a piece of an overlong one), a title/heading line, or a protected block
    or one of its pieces (a JSON item, bracket or member key, a table row or header, code lines or a fence), with
    its score."""

    start: int = Field(description="character offset into the original document text (inclusive)")
    end: int = Field(description="character offset (exclusive)")
    kind: UnitKind
    tokens: int = Field(description="tokens of this unit in the target LLM's tokenizer")
    score: float | None = Field(default=None, description="relevance probability (or raw attention score)")
    kept: bool = True
    rank: int | None = Field(
        default=None,
        description="its place by score among the context's candidate units (1: the best; ties: the earlier "
        "first), the order selection tries them in; None: a header row (heading, structure), or nothing scored",
    )
    reason: UnitReason | None = Field(
        default=None, description="why it was kept or dropped (rag_opt.explanation.REASONS says each in words)"
    )
    needed_by: int | None = Field(
        default=None,
        description="for a unit kept with another (an antecedent, a heading, a structure row): the index, in this "
        "document's units, of a kept unit that needs it",
    )
    scored_by: str | None = Field(
        default=None,
        description="what scored it: the scorer's method ('probe', 'raw-attention', 'bm25', ...), or "
        "'lexical-probe' for a lexical-tier decision (the lexical tier ran, or a structured row read by its "
        "lexical match); None: nothing scored",
    )


class OutputDocument(BaseModel):
    """A document of the result, in output order."""

    id: str = Field(description="the input id, or the input index as a string")
    index: int = Field(description="position of the document in the input")
    text: str = Field(
        description="the kept text: kept units verbatim, in original order (one space is inserted between two "
        "non-adjacent kept spans that would otherwise touch without whitespace; in JSON, the comma before the first "
        "kept item of an array or object is left out)"
    )
    metadata: dict[str, Any] = Field(default_factory=dict)
    title: str | None = Field(default=None, description="the title rag-opt read (see title_source)")
    title_source: str | None = Field(
        default=None,
        description="where the title was found: 'field' (the title field), 'metadata.<key>' (a metadata key; a "
        "file name's stem for source/file_path/file_name/filename), or 'text' (the text's leading heading line: it "
        "stays in text, so context() does not repeat it); None: no title",
    )
    score: float | None = Field(default=None, description="document relevance (calibrated when available)")
    raw_score: float | None = Field(default=None, description="document relevance before calibration")
    retriever_score: float | None = None
    kept_spans: list[tuple[int, int]] = Field(
        default_factory=list, description="character spans of the original text that were kept"
    )
    units: list[Unit] = Field(default_factory=list)
    tokens_before: int = 0
    tokens_after: int = 0


class Timings(BaseModel):
    """Milliseconds spent in each stage of one optimization.

    ``load_ms`` is the time the call spent loading its scorer (the proxy model and its probes on an optimizer's first
    model-tier call, the lexical probe on its first lexical one; 0 once loaded). ``total_ms`` is the whole call and
    includes ``load_ms``: ``total_ms - load_ms`` is the optimization's own time. ``score_ms`` never includes it."""

    segment_ms: float = Field(default=0.0, description="segmenting the documents into units")
    load_ms: float = Field(
        default=0.0,
        description="loading the scorer (the proxy model on an optimizer's first call; 0 once loaded); part of "
        "total_ms",
    )
    score_ms: float = Field(
        default=0.0, description="scoring the units (the proxy model's reading, or the lexical tier)"
    )
    select_ms: float = Field(default=0.0, description="choosing the units to keep")
    order_ms: float = Field(default=0.0, description="ordering the kept documents")
    total_ms: float = Field(default=0.0, description="the whole call, load_ms included")


class OptimizeResult(BaseModel):
    """What :func:`rag_opt.optimize` returns."""

    query: str
    documents: list[OutputDocument] = Field(description="kept documents in output order")
    dropped: list[OutputDocument] = Field(default_factory=list, description="documents with nothing kept")
    tokens_before: int
    tokens_after: int
    token_budget: int | None = Field(default=None, description="the target-token budget that was applied")
    over_budget: int = Field(
        default=0,
        description="target tokens kept over token_budget: a unit that did not fit was kept whole rather than "
        "empty the context (or a required document); see warnings",
    )
    target_tokenizer: str
    scorer: str = Field(description="'probe', 'raw-attention' or 'none' (no compression requested)")
    proxy_model: str | None = None
    calibrated: bool = Field(
        default=False,
        description="document scores are position-calibrated (document probe over calibrated attention)",
    )
    ordering: OrderingName = DEFAULT_ORDERING
    placement_profile: str | None = Field(
        default=None,
        description="calibrated ordering: the profile that placed the documents (the reader's, else the proxy's; "
        "None: end placement, or another ordering)",
    )
    tier: Literal["model", "lexical", "none"] = Field(
        default="none", description="which scorer tier ran: model, lexical, or none (nothing needed scoring)"
    )
    timings: Timings = Field(default_factory=Timings)
    warnings: list[str] = Field(default_factory=list)
    encoding: Literal["parallel", "joint"] | None = Field(
        default=None, description="how the proxy read the context (None: no proxy pass ran)"
    )
    cache_hits: int = Field(default=0, description="parallel encoding: documents (blocks) read from the cache")
    cache_misses: int = Field(default=0, description="parallel encoding: documents (blocks) encoded by this call")

    @property
    def ratio(self) -> float:
        """Achieved ratio of target-LLM tokens kept (1.0 for empty input)."""
        return self.tokens_after / self.tokens_before if self.tokens_before else 1.0

    @property
    def tokens_saved(self) -> int:
        return self.tokens_before - self.tokens_after

    def context(self, separator: str = "\n\n", *, with_titles: bool = True) -> str:
        """The optimized documents rendered as one context string."""
        parts = []
        for doc in self.documents:
            head = f"{doc.title}\n" if with_titles and doc.title and doc.title_source != "text" else ""
            parts.append(head + doc.text)
        return separator.join(parts)

    def to_json(self, *, indent: int | None = 2) -> str:
        data = self.model_dump(mode="json")
        data["ratio"] = self.ratio
        return json.dumps(data, indent=indent, ensure_ascii=False)
