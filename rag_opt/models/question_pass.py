"""The question pass of parallel encoding: the question and ``Answer:`` tokens read every cached block at once.

Each batch row holds one context's cached states (:mod:`rag_opt.models.question_buffer`) and, packed one after
the other, the questions asked over it; the capture (:mod:`rag_opt.models.capture`) reads the attention rows of
their tokens over the context's units. The prompt, its blocks and their tokens are
:mod:`rag_opt.models.parallel`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_opt.models import packed_linear, question_buffer
from rag_opt.models.capture import Capture, CaptureItem, StopForward, capturing
from rag_opt.models.parallel import ParallelPrompt, context_positions
from rag_opt.models.threads import QUESTION_PASS_THREADS

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.decoded_entries import DecodedEntries
    from rag_opt.models.kv_codec import EncodedStates
    from rag_opt.models.loader import ProxyModel

__all__ = ["QuestionPass", "question_mask", "run_question_passes"]


@dataclass
class QuestionPass:
    """One batch row of a question pass: the cached keys/values it reads and what the capture reads."""

    prompt: ParallelPrompt
    parts: list[EncodedStates]  # each (2, layers, KVH, n, d): keys then values of the prefix, then of each block

    @property
    def length(self) -> int:
        return sum(p.tokens for p in self.parts)


def question_mask(lengths: Sequence[int], questions: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
    """The 4D additive mask of a batched question pass. Batch row ``b`` holds ``C_b`` cached tokens (padded to the
    longest) and, packed one after the other, the questions of ``questions[b]`` (their token counts): a
    question's token ``i`` sees the row's cached tokens and its own question's tokens up to ``i``, never another
    question's. Padding is masked; padded query rows see the first key only (their output is never read)."""
    import torch

    c_max = max(lengths)
    s_max = max(sum(q) for q in questions)
    neg = torch.finfo(dtype).min
    mask = torch.full((len(lengths), 1, s_max, c_max + s_max), neg, dtype=dtype)
    causal = torch.tril(torch.ones(s_max, s_max, dtype=torch.bool))
    for b, (c, qs) in enumerate(zip(lengths, questions, strict=True)):
        off = 0
        for q in qs:
            mask[b, 0, off : off + q, :c] = 0.0
            own = mask[b, 0, off : off + q, c_max + off : c_max + off + q]
            own[causal[:q, :q]] = 0.0
            off += q
        mask[b, 0, off:, 0] = 0.0
    return mask


def run_question_passes(
    proxy: ProxyModel, rows: Sequence[QuestionPass], depth: int, decoded: DecodedEntries | None = None
) -> Capture:
    """One batched question pass over ``rows``' cached blocks, stopping after ``depth`` layers; returns the
    capture, whose items follow ``rows`` (attention rows of every row's question tokens and final token over its
    context tokens). ``decoded``: the cache's decoded entries, which compact blocks are read through.

    Rows that read the same cached states (the same documents, e.g. several questions over one retrieved set) are
    packed into one batch row: their cached states are stored once, and each question attends to them and to
    itself only. The cached states reach the attention function through the capture (:attr:`Capture.past`),
    which writes the pass's own keys and values after them and computes each question's attention over exactly
    its keys (:func:`rag_opt.models.capture._question_attention`). The pass still gives the model its 4D mask
    with the explicit position ids: without one, restarting positions would trigger transformers' packed-sequence
    detection. The caller holds ``proxy.lock``."""
    members = _packed(rows)
    lengths = [rows[m[0]].length for m in members]
    questions = [[len(rows[i].prompt.question_ids) for i in m] for m in members]
    c_max, s_max = max(lengths), max(sum(q) for q in questions)
    buf = question_buffer.assemble_states(proxy, [rows[m[0]].parts for m in members], depth, c_max, s_max, decoded)
    ids, positions, items = _question_inputs(proxy, rows, members, lengths, s_max)
    capture = Capture(
        items=items,
        stop_after=depth - 1 if depth < proxy.num_layers else None,
        past={layer: (buf[0, layer], buf[1, layer]) for layer in range(depth)},
        room_at=c_max,
    )
    packed_linear.pack_linears(proxy, depth)  # once per model: its small products through prepacked weights
    _forward(proxy, capture, ids, positions, question_mask(lengths, questions, proxy.dtype))
    if len(capture.sums) != depth:
        raise RuntimeError(
            f"captured attention from {len(capture.sums)} of {depth} layers: the proxy model's attention "
            "does not dispatch through transformers' AttentionInterface"
        )
    return capture


def _packed(rows: Sequence[QuestionPass]) -> list[list[int]]:
    """The rows of each batch row, in order of first appearance: rows that read the same cached states share one."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(id(p) for p in r.parts), []).append(i)
    return list(groups.values())


def _question_inputs(
    proxy: ProxyModel,
    rows: Sequence[QuestionPass],
    members: Sequence[Sequence[int]],
    lengths: Sequence[int],
    s_max: int,
) -> tuple[torch.Tensor, torch.Tensor, list[CaptureItem]]:
    """The pass's token ids and position ids ``(batch rows, s_max)``, each batch row's questions packed one after the
    other (the rest padding), and what the capture reads for each of ``rows``, in their order."""
    import torch

    dev = proxy.device
    pad = proxy.tokenizer.pad_token_id
    pad = pad if pad is not None else proxy.tokenizer.eos_token_id or 0
    ids = torch.full((len(members), s_max), int(pad), dtype=torch.long)
    positions = torch.zeros((len(members), s_max), dtype=torch.long)
    items: list[CaptureItem | None] = [None] * len(rows)
    for b, m in enumerate(members):
        off = 0
        # the row's questions read the same blocks: one context, its tensors shared (the capture reads them once)
        ctx_pos, unit_of = context_positions(rows[m[0]].prompt)
        ctx = torch.tensor(ctx_pos, dtype=torch.long, device=dev)
        unit_of_ctx = torch.tensor(unit_of, dtype=torch.long, device=dev)
        for i in m:
            prompt = rows[i].prompt
            q = len(prompt.question_ids)
            ids[b, off : off + q] = torch.tensor(prompt.question_ids)
            positions[b, off : off + q] = prompt.question_start + torch.arange(q)
            items[i] = CaptureItem(
                ctx_pos=ctx,
                unit_of_ctx=unit_of_ctx,
                n_units=prompt.n_units,
                # rows of the pass's own queries: the question's tokens, then the final token
                q_rows=torch.tensor([off + j for j in prompt.q_rows] + [off + q - 1], dtype=torch.long, device=dev),
                n_question_rows=len(prompt.q_rows),
                row=b,
                rows=(off, off + q),
                cached=lengths[b],
            )
            off += q
    return ids, positions, [it for it in items if it is not None]


def _forward(
    proxy: ProxyModel, capture: Capture, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> None:
    """The model's forward pass under ``capture``, stopped where the capture stops it."""
    import torch

    dev = proxy.device
    base = getattr(proxy.model, "model", None) or proxy.model.base_model
    with capturing(capture), torch.inference_mode():
        if dev == "cpu":
            proxy.threads.apply(cap=QUESTION_PASS_THREADS)
        try:
            base(input_ids=ids.to(dev), position_ids=positions.to(dev), attention_mask=mask.to(dev), use_cache=False)
        except StopForward:
            pass
