"""An MCP server (``rag-opt mcp``, stdio transport) with one tool, ``optimize_context``.

Agents that retrieve documents call it to compress them before reading: it takes the question, the documents
(strings or ``{text, id?, title?, metadata?}``) and optionally ``ratio`` or ``target_tokens``, and returns the
optimized context with the token counts. It only translates: one :class:`~rag_opt.ContextOptimizer`, built
by the caller, runs every call (one at a time, on a worker thread, so the server keeps answering). Errors
rag-opt raises on purpose (an empty question or document, a document without text or with an unknown field, a
ratio outside (0, 1], ``ratio`` and ``target_tokens`` together) come back as tool errors with rag-opt's message,
which names the document and the field; a missing argument or one of the wrong type is refused by the MCP SDK with
its own validation message.

Needs the ``mcp`` extra (``pip install 'rag-opt[mcp]'``: the ``mcp`` package, version 2).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from rag_opt.errors import ConfigurationError, InvalidInputError, RagOptError

if TYPE_CHECKING:  # pragma: no cover
    from mcp.server.mcpserver import MCPServer

    from rag_opt.pipeline import ContextOptimizer
    from rag_opt.types import OptimizeResult

__all__ = [
    "TOOL_NAME",
    "DocumentInput",
    "OptimizeContextResult",
    "OptimizedDocument",
    "build_server",
    "optimize_context",
    "serve_stdio",
]

logger = logging.getLogger(__name__)

TOOL_NAME = "optimize_context"

TOOL_DESCRIPTION = (
    "Compress retrieved documents for a question before reading them. Keeps the sentences that matter for the "
    "question, verbatim and in order, under a token budget (ratio of the input tokens, or a number of tokens), "
    "and drops documents with nothing relevant. Returns the optimized context (each kept document's title line "
    "and kept text, separated by blank lines), the kept documents with their ids and relevance scores, and the "
    "token counts before and after."
)

INSTRUCTIONS = (
    "rag-opt compresses retrieved context for a question: call optimize_context with the question and the "
    "documents you retrieved, then read the returned context instead of the full documents."
)


class DocumentInput(BaseModel):
    """A document given as an object (a plain string is a document too)."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="the document's text")
    id: str | int | None = Field(default=None, description="an id to recognise the document by in the result")
    title: str | None = Field(default=None, description="its title (helps scoring; kept as a title line)")
    metadata: dict[str, Any] | None = Field(default=None, description="returned unchanged with the document")
    score: float | None = Field(default=None, description="the retriever's score, if any")


class OptimizedDocument(BaseModel):
    """A kept document, in output order."""

    id: str = Field(description="the input id, or the input index as a string")
    index: int = Field(description="position of the document in the input")
    title: str | None = None
    text: str = Field(description="the kept sentences, verbatim and in their original order")
    score: float | None = Field(default=None, description="document relevance")
    metadata: dict[str, Any] = Field(default_factory=dict)


class OptimizeContextResult(BaseModel):
    """What ``optimize_context`` returns."""

    context: str = Field(description="the optimized context: kept documents (title line, kept text)")
    tokens_before: int = Field(description="tokens of the documents before, in the target tokenizer")
    tokens_after: int = Field(description="tokens of the kept text after")
    ratio: float = Field(description="tokens_after / tokens_before")
    target_tokenizer: str = Field(description="the tokenizer the tokens are counted in")
    documents: list[OptimizedDocument] = Field(description="kept documents, in output order")
    dropped_ids: list[str] = Field(default_factory=list, description="ids of documents with nothing kept")
    warnings: list[str] = Field(default_factory=list)


def optimize_context(
    optimizer: ContextOptimizer,
    question: str,
    documents: list[str | DocumentInput] | list[Any],
    *,
    ratio: float | None = None,
    target_tokens: int | None = None,
) -> OptimizeContextResult:
    """The tool's work: ``optimizer.optimize(...)`` and its result in the tool's output shape.

    Without ``ratio`` and ``target_tokens`` the optimizer's own budget applies.
    """
    if not isinstance(question, str) or not question.strip():
        raise InvalidInputError("question is empty" if isinstance(question, str) else "question must be a string")
    docs = [d.model_dump(exclude_none=True) if isinstance(d, DocumentInput) else d for d in documents]
    result = optimizer.optimize(question, docs, ratio=ratio, target_tokens=target_tokens)
    return _to_output(result)


def _to_output(result: OptimizeResult) -> OptimizeContextResult:
    return OptimizeContextResult(
        context=result.context(),
        tokens_before=result.tokens_before,
        tokens_after=result.tokens_after,
        ratio=result.ratio,
        target_tokenizer=result.target_tokenizer,
        documents=[
            OptimizedDocument(id=d.id, index=d.index, title=d.title, text=d.text, score=d.score, metadata=d.metadata)
            for d in result.documents
        ],
        dropped_ids=[d.id for d in result.dropped],
        warnings=result.warnings,
    )


def _documents_schema() -> dict[str, Any]:
    return {
        "type": "array",
        "items": {"anyOf": [{"type": "string"}, DocumentInput.model_json_schema()]},
        "description": "the retrieved documents: strings or {text, id?, title?, metadata?} objects",
    }


def build_server(optimizer: ContextOptimizer, *, name: str = "rag-opt") -> MCPServer:
    """An MCP server whose ``optimize_context`` tool runs ``optimizer`` (one call at a time)."""
    try:
        from mcp.server.mcpserver import MCPServer
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:
        raise ConfigurationError("the MCP server needs the mcp extra (mcp 2): pip install 'rag-opt[mcp]'") from None
    import anyio.to_thread

    from rag_opt import __version__

    server = MCPServer(name, instructions=INSTRUCTIONS, version=__version__)
    lock = threading.Lock()  # the proxy model runs one optimization at a time

    def run(question: str, documents: list[Any], ratio: float | None, target_tokens: int | None) -> Any:
        with lock:
            return optimize_context(optimizer, question, documents, ratio=ratio, target_tokens=target_tokens)

    async def tool(
        question: Annotated[str, Field(description="the question the documents should answer")],
        documents: Annotated[
            list[Any],  # checked by rag-opt (its messages name the document and the field), advertised as:
            WithJsonSchema(_documents_schema()),
            Field(description="the retrieved documents: strings or {text, id?, title?, metadata?} objects"),
        ],
        ratio: Annotated[
            float | None,
            Field(description="fraction of the documents' tokens to keep, in (0, 1]; default: the server's"),
        ] = None,
        target_tokens: Annotated[
            int | None, Field(description="token budget for the kept text (instead of ratio)")
        ] = None,
    ) -> OptimizeContextResult:
        try:
            out: OptimizeContextResult = await anyio.to_thread.run_sync(run, question, documents, ratio, target_tokens)
        except RagOptError as exc:
            raise ToolError(str(exc)) from None
        logger.info(
            "optimize_context: %d documents, %d -> %d tokens", len(documents), out.tokens_before, out.tokens_after
        )
        return out

    server.add_tool(tool, name=TOOL_NAME, title="Optimize retrieved context", description=TOOL_DESCRIPTION)
    return server


def serve_stdio(optimizer: ContextOptimizer) -> None:
    """Serve the tool over stdin/stdout until the client closes the connection."""
    build_server(optimizer).run("stdio")
