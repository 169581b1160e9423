"""Document passes of parallel encoding: ``prefix + block`` through the proxy, keeping each layer's key/value states.

A block's states depend on nothing but the shared prefix and its own tokens (:mod:`rag_opt.models.parallel`),
so blocks of any contexts can share a forward pass: they are sorted by length and right-padded into batches of
at most ``batch_tokens`` tokens and of about one length (causal attention: no real token reads the padding after
it, and SDPA keeps its fast causal path). The forward pass stops after the last layer needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rag_opt.models.capture import Capture, StopForward, capturing
from rag_opt.work import checkpoint

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.loader import ProxyModel

__all__ = ["encode_blocks", "encode_blocks_with_sources"]


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
    order = sorted(range(len(blocks)), key=lambda i: len(blocks[i]))
    out: list[torch.Tensor | None] = [None] * len(blocks)
    queries: list[torch.Tensor | None] = [None] * len(blocks)
    prefix_states: torch.Tensor | None = None
    batch: list[int] = []
    p = len(prefix)
    for i in [*order, -1]:
        width = p + len(blocks[i]) if i >= 0 else 0
        # a batch holds blocks of about one length: on a CPU a forward pass costs about the same per token at any
        # batch size, so padding is pure waste (sorted by length, a new batch starts past 1.2x the shortest)
        if batch and (
            i < 0 or width * (len(batch) + 1) > batch_tokens or width > 1.2 * (p + len(blocks[batch[0]])) + 8
        ):
            checkpoint()  # between forward passes: stop here if the caller gave up (rag_opt.work)
            rows = None if sources is None else [sources[j] for j in batch]
            pre, states, qs = _run(proxy, prefix, [blocks[j] for j in batch], depth, rows)
            prefix_states = pre if prefix_states is None else prefix_states
            for k, (j, s) in enumerate(zip(batch, states, strict=True)):
                out[j] = s
                queries[j] = None if qs is None else qs[k]
            batch = []
        if i >= 0:
            batch.append(i)
    assert prefix_states is not None and all(s is not None for s in out)
    kept = None if sources is None else [q for q in queries if q is not None]
    return prefix_states, [s for s in out if s is not None], kept


def _run(
    proxy: ProxyModel,
    prefix: Sequence[int],
    blocks: Sequence[Sequence[int]],
    depth: int,
    sources: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor] | None]:
    import torch

    dev = proxy.device
    p = len(prefix)
    width = p + max(len(b) for b in blocks)
    pad = proxy.tokenizer.pad_token_id
    pad = pad if pad is not None else proxy.tokenizer.eos_token_id or 0
    ids = torch.tensor([[*prefix, *b] + [pad] * (width - p - len(b)) for b in blocks], device=dev)
    capture = Capture(items=[], stop_after=depth - 1 if depth < proxy.num_layers else None, keep_kv=True)
    if sources is not None:  # positions in the pass: after the prefix
        capture.keep_q = [torch.tensor([p + i for i in rows], dtype=torch.long, device=dev) for rows in sources]
    base = getattr(proxy.model, "model", None) or proxy.model.base_model
    with capturing(capture), proxy.lock, torch.inference_mode():
        if dev == "cpu":
            proxy.threads.apply()
        try:
            base(input_ids=ids, use_cache=False)
        except StopForward:
            pass
        if len(capture.kv) < depth:
            raise RuntimeError(
                f"captured key/value states from {len(capture.kv)} of {depth} layers: the proxy model's attention "
                "does not dispatch through transformers' AttentionInterface"
            )
        keys = torch.stack([capture.kv[layer][0] for layer in range(depth)], dim=1)  # (B, L, KVH, T, d)
        values = torch.stack([capture.kv[layer][1] for layer in range(depth)], dim=1)
        both = torch.stack([keys, values], dim=1).cpu()  # (B, 2, L, KVH, T, d)
        queries = None
        if sources is not None:
            queries = [
                torch.stack([capture.q[layer][b] for layer in range(depth)]).cpu().clone() for b in range(len(blocks))
            ]  # per block (L, H, S, d)
    prefix_states = both[0, :, :, :, :p].clone()
    return prefix_states, [both[b, :, :, :, p : p + len(blk)].clone() for b, blk in enumerate(blocks)], queries
