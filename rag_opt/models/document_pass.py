"""Document passes of parallel encoding: ``prefix + block`` through the proxy, keeping each layer's key/value states.

A block's states depend on nothing but the shared prefix and its own tokens (:mod:`rag_opt.models.parallel`),
so blocks of any contexts can share a forward pass. They are *packed*: ``prefix + block`` for each block, one
after the other in one batch row of at most ``batch_tokens`` and :data:`PASS_TOKENS` tokens, with position ids
that restart for each, and an attention that reads each sequence causally over itself only (SDPA's causal path
per sequence: :attr:`rag_opt.models.capture.Capture.segments`; no ``T x T`` mask is made). No token is padding,
and the linear layers see long rows, which a CPU runs faster per token than short ones (bf16, one thread: 0.8 us
a token for 1,800 tokens against 1.1-2.3 us for the 65-230-token batches of length-sorted padding this
replaced). The forward pass stops after the last layer needed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rag_opt.models.capture import Capture, StopForward, capturing
from rag_opt.work import checkpoint, progress_shown

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.loader import ProxyModel

__all__ = ["PASS_TOKENS", "PROGRESS_TOKENS", "encode_blocks", "encode_blocks_with_sources"]

logger = logging.getLogger(__name__)

# new tokens from which reading the documents is announced (a log line) and may show a progress bar (tqdm, drawn
# only on a terminal and once 2 s have passed; off in a server's scope: rag_opt.work.scope(progress=False))
PROGRESS_TOKENS = 16_384

# the most tokens one packed pass holds (at most ``batch_tokens``): a longer row runs its elementwise layers
# (norms, rotary embeddings, the MLP's gating) on activations that no longer fit the CPU's caches. Cold requests,
# one thread, bf16, per-question medians against passes of 2,048 tokens (benchmarks/ablations/packed_pass.py,
# interleaved): at 40 HotpotQA paragraphs (~5,500 tokens) 1,536 tokens 1.03x the time, 3,072 1.01x, 6,144 (one
# pass) 1.20x, the length-sorted padded batches this replaced 1.18x; at 10 paragraphs (one pass) padded 1.34x
PASS_TOKENS = 2048


def encode_blocks(
    proxy: ProxyModel,
    prefix: Sequence[int],
    blocks: Sequence[Sequence[int]],
    depth: int,
    *,
    batch_tokens: int = 6144,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Key/value states of the first ``depth`` layers for every block: ``(prefix_states, [block_states])``, each
    a tensor ``(2, depth, kv_heads, tokens, head_dim)`` (keys then values, rotary embeddings applied) in the
    model's dtype, on the CPU. The prefix's states are the same in every pass (they read only the prefix)."""
    prefix_states, states, _ = _encode(proxy, prefix, blocks, depth, batch_tokens, None)
    return prefix_states, states


def encode_blocks_with_sources(
    proxy: ProxyModel,
    prefix: Sequence[int],
    blocks: Sequence[Sequence[int]],
    sources: Sequence[Sequence[int]],
    depth: int,
    *,
    batch_tokens: int = 6144,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """:func:`encode_blocks`, plus the query states of each block's ``sources`` (token indices in the block: the
    last token of each of its units), ``(depth, heads, sources, head_dim)`` per block (rotary embeddings applied
    at the block's own positions), for the cross-document reading (:mod:`rag_opt.models.parallel_cross`)."""
    prefix_states, states, queries = _encode(proxy, prefix, blocks, depth, batch_tokens, sources)
    assert queries is not None
    return prefix_states, states, queries


def _encode(
    proxy: ProxyModel,
    prefix: Sequence[int],
    blocks: Sequence[Sequence[int]],
    depth: int,
    batch_tokens: int,
    sources: Sequence[Sequence[int]] | None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor] | None]:
    if not blocks:
        raise ValueError("no blocks to encode")
    out: list[torch.Tensor] = []
    queries: list[torch.Tensor] = []
    prefix_states: torch.Tensor | None = None
    batch: list[int] = []
    p = len(prefix)
    limit = min(batch_tokens, PASS_TOKENS)
    bar = _progress(sum(len(b) for b in blocks))
    try:
        for i in [*range(len(blocks)), -1]:
            # a pass packs whole sequences up to ``limit`` tokens (a longer one has a pass of its own)
            if batch and (i < 0 or sum(p + len(blocks[j]) for j in batch) + p + len(blocks[i]) > limit):
                checkpoint()  # between forward passes: stop here if the caller gave up (rag_opt.work)
                rows = None if sources is None else [sources[j] for j in batch]
                pre, states, qs = _run(proxy, prefix, [blocks[j] for j in batch], depth, rows)
                prefix_states = pre if prefix_states is None else prefix_states
                out.extend(states)
                queries.extend(qs or [])
                if bar is not None:
                    bar.update(sum(len(blocks[j]) for j in batch))
                batch = []
            if i >= 0:
                batch.append(i)
    finally:
        if bar is not None:
            bar.close()
    assert prefix_states is not None and len(out) == len(blocks)
    return prefix_states, out, None if sources is None else queries


def _progress(tokens: int) -> Any:
    """A progress bar over ``tokens`` new document tokens, or None below :data:`PROGRESS_TOKENS` (or where the
    caller's scope turned progress off)."""
    if tokens < PROGRESS_TOKENS:
        return None
    logger.info("reading %d new document tokens with the proxy model (cost grows linearly with them)", tokens)
    if not progress_shown():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=tokens, unit="tok", desc="rag-opt: reading documents", delay=2, disable=None, leave=False)


def _run(
    proxy: ProxyModel,
    prefix: Sequence[int],
    blocks: Sequence[Sequence[int]],
    depth: int,
    sources: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor] | None]:
    """One packed forward pass of ``prefix + block`` for every block (one batch row, no padding)."""
    import torch

    dev = proxy.device
    p = len(prefix)
    segments: list[tuple[int, int]] = []
    ids: list[int] = []
    positions: list[int] = []
    for b in blocks:
        segments.append((len(ids), len(ids) + p + len(b)))
        ids += [*prefix, *b]
        positions += range(p + len(b))
    capture = Capture(
        items=[], stop_after=depth - 1 if depth < proxy.num_layers else None, keep_kv=True, segments=segments
    )
    if sources is not None:  # positions in the packed row: after each sequence's prefix
        capture.keep_q = [
            torch.tensor(
                [s + p + i for (s, _), rows in zip(segments, sources, strict=True) for i in rows],
                dtype=torch.long,
                device=dev,
            )
        ]
    base = getattr(proxy.model, "model", None) or proxy.model.base_model
    with capturing(capture), proxy.lock, torch.inference_mode():
        if dev == "cpu":
            proxy.threads.apply()
        try:
            base(
                input_ids=torch.tensor([ids], device=dev),
                position_ids=torch.tensor([positions], device=dev),
                use_cache=False,
            )
        except StopForward:
            pass
        if len(capture.kv) < depth:
            raise RuntimeError(
                f"captured key/value states from {len(capture.kv)} of {depth} layers: the proxy model's attention "
                "does not dispatch through transformers' AttentionInterface"
            )
        keys = torch.stack([capture.kv[layer][0][0] for layer in range(depth)])  # (L, KVH, T, d)
        values = torch.stack([capture.kv[layer][1][0] for layer in range(depth)])
        both = torch.stack([keys, values]).cpu()  # (2, L, KVH, T, d)
        queries = None
        if sources is not None:
            kept = torch.stack([capture.q[layer][0] for layer in range(depth)]).cpu()  # (L, H, all sources, d)
            counts = [len(rows) for rows in sources]
            queries = [part.clone() for part in torch.split(kept, counts, dim=2)]  # per block (L, H, S, d)
    prefix_states = both[:, :, :, :p].clone()
    return prefix_states, [both[:, :, :, s + p : e].clone() for s, e in segments], queries
