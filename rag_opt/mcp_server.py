"""An MCP server (``rag-opt mcp``, stdio transport) with one tool, ``optimize_context``.

Agents that retrieve documents call it to compress them before reading: it takes the question, the documents
(strings or ``{text, id?, title?, metadata?}``) and optionally ``ratio`` or ``target_tokens``, and returns the
optimized context with the token counts. It only translates: one :class:`~rag_opt.ContextOptimizer`, built
by the caller, runs every call (one at a time, on a worker thread, so the server keeps answering). Errors
rag-opt raises on purpose (an empty question or document, a document without text or with an unknown field, a
ratio outside (0, 1], ``ratio`` and ``target_tokens`` together) come back as tool errors with rag-opt's message,
which names the document and the field; a missing argument or one of the wrong type is refused by the MCP SDK with
its own validation message.

A call is limited as ``rag-opt serve`` limits a request (:class:`~rag_opt.server.service_limits.ServiceLimits`, the same
flags and ``RAG_OPT_*`` variables): more than ``max_documents`` documents is refused before anything runs; a
question over ``max_question_tokens``, a context over ``max_units`` or ``max_proxy_tokens`` stop the optimization
before its expensive stages; an optimization still running after ``time_budget_ms`` (counted once the proxy model
is loaded and the call's turn has come) is cancelled at its next checkpoint. Each is a tool error that says
which limit. A call the client cancels, or one running when the server stops, is cancelled the same way.
:func:`serve_stdio` answers every line it cannot read with a JSON-RPC error (:mod:`rag_opt.mcp_stdio`) and stops
at once on SIGTERM or SIGINT.

Needs the ``mcp`` extra (``pip install -e '.[mcp]'`` from the checkout: the ``mcp`` package, version 2).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from rag_opt.errors import Cancelled, ConfigurationError, InvalidInputError, RagOptError, WorkLimitExceeded
from rag_opt.install import install_hint
from rag_opt.server.service_limits import ServiceLimits
from rag_opt.work import scope

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


class _Calls:
    """Runs the tool's optimizations one at a time under the limits, each cancellable (on its own thread)."""

    def __init__(self, optimizer: ContextOptimizer, limits: ServiceLimits) -> None:
        self.optimizer = optimizer
        self.limits = limits
        self._lock = threading.Lock()  # the proxy model runs one optimization at a time

    def run(
        self,
        question: str,
        documents: list[Any],
        ratio: float | None,
        target_tokens: int | None,
        cancel: threading.Event,
    ) -> OptimizeContextResult:
        limits = self.limits
        if isinstance(documents, list) and len(documents) > limits.max_documents:
            raise WorkLimitExceeded(
                f"documents: {len(documents)} documents, more than this server's limit of {limits.max_documents} "
                "(--max-documents)"
            )
        with self._lock:
            if cancel.is_set():
                raise Cancelled("the call was cancelled before it started")
            load = getattr(self.optimizer, "scorer", None)
            if callable(load):  # the proxy model loads before the time budget starts (once)
                load()
            over_time = threading.Event()

            def time_out() -> None:
                over_time.set()
                cancel.set()

            timer = threading.Timer(limits.time_budget_s, time_out)
            timer.daemon = True
            timer.start()
            try:
                with scope(limits=limits.work_limits(), cancel=cancel, progress=False):
                    return optimize_context(
                        self.optimizer, question, documents, ratio=ratio, target_tokens=target_tokens
                    )
            except Cancelled:
                if over_time.is_set():
                    raise WorkLimitExceeded(
                        f"the optimization ran past this server's time budget of {limits.time_budget_ms:g} ms "
                        "(--time-budget-ms); give fewer or shorter documents"
                    ) from None
                raise
            finally:
                timer.cancel()


def build_server(
    optimizer: ContextOptimizer, *, name: str = "rag-opt", limits: ServiceLimits | None = None
) -> MCPServer:
    """An MCP server whose ``optimize_context`` tool runs ``optimizer`` (one call at a time) within ``limits``
    (default: the defaults of ``rag-opt serve``'s)."""
    try:
        from mcp.server.mcpserver import MCPServer
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:
        raise ConfigurationError(f"the MCP server needs the mcp extra (mcp 2): {install_hint('mcp')}") from None
    import anyio
    import anyio.to_thread

    from rag_opt import __version__

    server = MCPServer(name, instructions=INSTRUCTIONS, version=__version__)
    calls = _Calls(optimizer, limits if limits is not None else ServiceLimits.from_sources({}, {}))

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
        cancel = threading.Event()
        try:
            out: OptimizeContextResult = await anyio.to_thread.run_sync(
                calls.run, question, documents, ratio, target_tokens, cancel, abandon_on_cancel=True
            )
        except RagOptError as exc:
            raise ToolError(str(exc)) from None
        except anyio.get_cancelled_exc_class():  # the client cancelled the call, or the server is stopping
            cancel.set()  # the optimization stops at its next checkpoint
            raise
        logger.info(
            "optimize_context: %d documents, %d -> %d tokens", len(documents), out.tokens_before, out.tokens_after
        )
        return out

    server.add_tool(tool, name=TOOL_NAME, title="Optimize retrieved context", description=TOOL_DESCRIPTION)
    return server


def serve_stdio(optimizer: ContextOptimizer, limits: ServiceLimits | None = None) -> int | None:
    """Serve the tool over stdin/stdout (:mod:`rag_opt.mcp_stdio`) until the client closes the connection (returns
    None) or the process gets SIGTERM or SIGINT (returns the signal's number, at once: a running optimization is
    cancelled, not waited for; the caller should exit, as ``rag-opt mcp`` does)."""
    import anyio

    limits = limits if limits is not None else ServiceLimits.from_sources({}, {})
    server = build_server(optimizer, limits=limits)
    result: int | None = anyio.run(_serve, server, limits)
    return result


async def _serve(server: MCPServer, limits: ServiceLimits) -> int | None:
    import anyio

    from rag_opt.mcp_stdio import stdio_transport

    lowlevel = server._lowlevel_server  # MCPServer.run_stdio_async, on rag-opt's stdin
    stopped: list[int] = []
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            # a handler of its own: also where the process was started with SIGTERM ignored
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    logger.info("got signal %d: stopping", signum)
                    stopped.append(int(signum))
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        async with stdio_transport(limits.max_body_bytes) as (read_stream, write_stream):
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())
        tg.cancel_scope.cancel()
    return stopped[0] if stopped else None
