"""The prompt the proxy model reads: ``Documents:``, the documents' units verbatim, then the question.

The layout is versioned (:data:`TEMPLATE_ID`): probes and calibration profiles record the template they were
made with and are refused under another one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ANSWER_SUFFIX",
    "CONTEXT_PREFIX",
    "DEFAULT_ENCODING",
    "DOC_SEPARATOR",
    "ENCODINGS",
    "PARALLEL_TEMPLATE_ID",
    "QUESTION_PREFIX",
    "TEMPLATE_ID",
    "VIEWS",
    "PromptLayout",
    "render_prompt",
    "template_for",
]

VIEWS = ("last", "question")
CONTEXT_PREFIX = "Documents:\n"  # takes the first position, whose attention-sink role would distort document 1
QUESTION_PREFIX = "Question: "
ANSWER_SUFFIX = "\nAnswer:"
DOC_SEPARATOR = "\n\n"
TEMPLATE_ID = "ctx-q-v2"  # the joint encoding's; changes whenever the prompt layout below changes
# the same text read with parallel encoding (rag_opt.models.parallel): each document on its own, then the question
PARALLEL_TEMPLATE_ID = "ctx-q-par-v1"
ENCODINGS = ("parallel", "joint")
DEFAULT_ENCODING = "parallel"  # what ContextOptimizer, the CLI and the server read with unless told otherwise


def template_for(encoding: str) -> str:
    """The template id of an encoding: what probes, profiles and feature caches record and are checked against."""
    if encoding == "joint":
        return TEMPLATE_ID
    if encoding == "parallel":
        return PARALLEL_TEMPLATE_ID
    from rag_opt.errors import InvalidInputError

    raise InvalidInputError(f"unknown encoding {encoding!r}; use one of {list(ENCODINGS)}")


@dataclass(frozen=True)
class PromptLayout:
    """A rendered prompt with the character span of every unit and of the question."""

    text: str
    unit_spans: list[tuple[int, int]]
    unit_doc: list[int]
    question_span: tuple[int, int]


def render_prompt(docs: Sequence[Sequence[str]], question: str) -> PromptLayout:
    """Render ``docs`` (each a sequence of unit strings, concatenated verbatim) and the question.

    Layout: ``Documents:``, the documents separated by a blank line, then ``Question: <question>`` and
    ``Answer:``. The prefix keeps the model's attention sink (the first token) out of the documents.
    """
    parts: list[str] = [CONTEXT_PREFIX]
    spans: list[tuple[int, int]] = []
    unit_doc: list[int] = []
    pos = len(CONTEXT_PREFIX)
    for d, units in enumerate(docs):
        if d:
            parts.append(DOC_SEPARATOR)
            pos += len(DOC_SEPARATOR)
        for unit in units:
            parts.append(unit)
            spans.append((pos, pos + len(unit)))
            unit_doc.append(d)
            pos += len(unit)
    parts.append(DOC_SEPARATOR + QUESTION_PREFIX)
    pos += len(DOC_SEPARATOR) + len(QUESTION_PREFIX)
    q_span = (pos, pos + len(question))
    parts.append(question)
    parts.append(ANSWER_SUFFIX)
    return PromptLayout("".join(parts), spans, unit_doc, q_span)
