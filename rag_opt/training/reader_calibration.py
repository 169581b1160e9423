"""Measuring a reader's positional profile (``rag-opt calibrate --reader``): the model that *reads* the context.

Two ways, by what the reader is:

* **a local model** (a Hugging Face id, folder or GGUF rag-opt can load): its attention share per document slot
  with non-relevant NQ passages in every slot, exactly as the proxy's profile is measured
  (:func:`rag_opt.training.calibration.estimate_profile`), under rag-opt's documents-then-question prompt;
* **an API** (an OpenAI-compatible chat completions upstream, the one the proxy forwards to): its accuracy per
  slot on NQ questions of the calibration split, the relevant passage placed at each slot of a grid among
  non-relevant ones (Liu et al. 2023's setting and prompt), answered greedily. The number of requests is bounded
  (``max_requests``); slots between grid points are interpolated.
* **a local model by its accuracy** (``--method accuracy``): the same measurement, the model answering in process
  (:class:`LocalChatReader`). Attention shares and accuracy need not agree: a reader can attend to the first and
  the last slot alike and still answer from the first one far more often.

Both give a :class:`rag_opt.orderers.reader_profiles.ReaderProfile`, which ``ordering="calibrated"`` reads. The
NQ calibration split (index % 10 == 0) is never measured on by the benchmarks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rag_opt.errors import InvalidInputError, RagOptError
from rag_opt.orderers.reader_profiles import ReaderProfile
from rag_opt.training.datasets import NQExample, normalize_answer

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.models.loader import ProxyModel

__all__ = [
    "INSTRUCTION",
    "LocalChatReader",
    "OpenAIChatReader",
    "ReaderCallError",
    "best_subspan_em",
    "reader_accuracy_profile",
    "reader_attention_profile",
    "reader_messages",
    "render_search_results",
    "slot_grid",
]

logger = logging.getLogger(__name__)

INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant). Answer with a short phrase only."
)

Messages = list[dict[str, str]]


class ReaderCallError(RagOptError, RuntimeError):
    """The reader's API did not answer a calibration request usably (status, body or transport)."""


def best_subspan_em(prediction: str, answers: Sequence[str]) -> float:
    """Liu et al. (2023)'s metric: a normalised gold answer is a substring of the normalised prediction."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(a) and normalize_answer(a) in pred for a in answers))


def render_search_results(documents: Sequence[tuple[str, str]]) -> str:
    """``Document [i](Title: t) text``, one per line, as in Liu et al. (2023)."""
    return "\n".join(f"Document [{i}](Title: {title}) {text}" for i, (title, text) in enumerate(documents, 1))


def reader_messages(question: str, context: str) -> Messages:
    """The paper's prompt as chat messages: the instruction, then the numbered documents and the question."""
    return [
        {"role": "system", "content": INSTRUCTION},
        {"role": "user", "content": f"{context}\n\nQuestion: {question}\nAnswer:"},
    ]


def slot_grid(n_docs: int) -> list[int]:
    """The 0-based slots the relevant passage is put at: the first, every fifth (slot 5, 10, ...) and the last,
    as in the paper's curves (10 documents: 1, 5, 10; 20: 1, 5, 10, 15, 20)."""
    if n_docs < 1:
        raise InvalidInputError(f"n_docs must be >= 1, got {n_docs}")
    return sorted({0, n_docs - 1, *range(4, n_docs, 5)})


class OpenAIChatReader:
    """A reader behind an OpenAI-compatible ``POST {upstream}/chat/completions`` (``upstream`` is the base URL,
    e.g. ``http://localhost:8080/v1``), answering greedily in at most ``max_tokens`` tokens. ``transport``: an
    httpx transport (tests use a mock upstream)."""

    def __init__(
        self,
        upstream: str,
        model: str,
        *,
        api_key: str | None = None,
        max_tokens: int = 32,
        timeout: float = 120.0,
        transport: Any = None,
    ) -> None:
        import httpx

        if not upstream.startswith(("http://", "https://")):
            raise InvalidInputError(f"the reader's upstream must be an http(s) URL, got {upstream!r}")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.max_tokens = max_tokens
        self.requests = 0
        self._client = httpx.Client(
            base_url=upstream.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )

    def __call__(self, messages: Messages) -> str:
        import httpx

        body = {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": self.max_tokens}
        self.requests += 1
        try:
            r = self._client.post("/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise ReaderCallError(f"the reader's upstream failed: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise ReaderCallError(f"the reader's upstream answered {r.status_code}: {r.text[:300]}")
        try:
            content = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ReaderCallError(f"the reader's upstream sent no chat completion: {r.text[:300]}") from None
        return content if isinstance(content, str) else ""

    def close(self) -> None:
        self._client.close()


class LocalChatReader:
    """A local causal LM (loaded by :func:`rag_opt.models.loader.load_proxy_model`) answering chat messages with
    its chat template, greedily, in at most ``max_tokens`` tokens: the in-process counterpart of
    :class:`OpenAIChatReader` for an accuracy profile."""

    def __init__(self, model: ProxyModel, *, max_tokens: int = 32) -> None:
        if max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be positive, got {max_tokens}")
        if getattr(model.tokenizer, "chat_template", None) is None:
            raise InvalidInputError(f"{model.name} has no chat template: it cannot answer chat messages")
        self.lm = model
        self.max_tokens = max_tokens
        self.requests = 0

    def __call__(self, messages: Messages) -> str:
        import torch

        tok: Any = self.lm.tokenizer
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
        enc = enc.to(self.lm.device)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.requests += 1
        model: Any = self.lm.model
        with self.lm.lock, torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=self.max_tokens, do_sample=False, pad_token_id=pad)
        return str(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))


def reader_accuracy_profile(
    answer: Callable[[Messages], str],
    reader: str,
    n_docs: int,
    records: Sequence[NQExample],
    *,
    max_requests: int = 200,
    slots: Sequence[int] | None = None,
    progress: bool = True,
) -> ReaderProfile:
    """The reader's accuracy per slot: for ``max_requests // len(slots)`` questions of ``records`` (each with at
    least ``n_docs - 1`` distractors), the relevant passage at every slot of ``slots`` (0-based; default
    :func:`slot_grid`), one request each. Accuracy between measured slots is interpolated."""
    from tqdm.auto import tqdm

    grid = sorted(set(slots if slots is not None else slot_grid(n_docs)))
    if not grid or grid[0] < 0 or grid[-1] >= n_docs:
        raise InvalidInputError(f"slots must be within 0..{n_docs - 1}, got {grid}")
    per_slot = max_requests // len(grid)
    if per_slot < 1:
        raise InvalidInputError(
            f"max_requests {max_requests} is less than one question per measured slot ({len(grid)} slots)"
        )
    usable = [ex for ex in records if len(ex.distractors) >= n_docs - 1][:per_slot]
    if not usable:
        raise InvalidInputError(f"no calibration question has the {n_docs - 1} distractors {n_docs} documents need")
    correct = np.zeros(len(grid))
    bar = tqdm(total=len(usable) * len(grid), desc=f"reader {reader}, {n_docs} slots", disable=not progress)
    for ex in usable:
        for k, slot in enumerate(grid):
            docs = ex.documents(n_docs, slot)
            context = render_search_results([(d.get("title", ""), d["text"]) for d in docs])
            correct[k] += best_subspan_em(answer(reader_messages(ex.question, context)), ex.answers)
            bar.update()
    bar.close()
    accuracy = correct / len(usable)
    weights = np.interp(np.arange(n_docs), np.asarray(grid, dtype=np.float64), accuracy)
    logger.info("reader %s accuracy per slot %s: %s", reader, [s + 1 for s in grid], np.round(accuracy, 3).tolist())
    return ReaderProfile(
        reader=reader,
        n_docs=n_docs,
        method="accuracy",
        slot_weight=weights,
        contexts=len(usable),
        metadata={
            "data": "nq_multidoc calibration split (index % 10 == 0), relevant passage among distractors",
            "measured_slots": [s + 1 for s in grid],
            "accuracy": [round(float(a), 4) for a in accuracy],
            "requests": len(usable) * len(grid),
            "metric": "best_subspan_em",
        },
    )


def reader_attention_profile(
    model: ProxyModel, contexts: Sequence[tuple[Sequence[str], str]], n_docs: int, *, progress: bool = True
) -> ReaderProfile:
    """The local reader ``model``'s attention share per slot (from the final token, mean over layers and heads),
    over ``contexts`` of ``n_docs`` non-relevant passages
    (:func:`rag_opt.training.calibration.nq_calibration_contexts`)."""
    from rag_opt.training.calibration import estimate_profile

    profile = estimate_profile(model, contexts, n_docs, progress=progress)
    return ReaderProfile(
        reader=model.name,
        n_docs=n_docs,
        method="attention",
        slot_weight=profile.slot_attention("last"),
        contexts=profile.contexts,
        metadata={
            "data": "nq_multidoc calibration split (distractors only)",
            "view": "last token, mean over layers and heads",
            "template": profile.template,
        },
    )
